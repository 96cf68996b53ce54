"""torchrec's own module tests, run on recom_rec's modules with the imports swapped.

torchrec's tests of its float and quantized EmbeddingBagCollection and EmbeddingCollection, and of
the managed-collision and feature-processed wrappers around them, are not in its wheel (and their
code is not ours to copy). Given a checkout of pytorch/torchrec, this copies those test files into a
temporary folder beside a conftest.py that points torchrec's module names at ours before the tests
import them (``torchrec.modules.embedding_modules.EmbeddingBagCollection`` -> ours, and likewise the
EmbeddingCollection and the quantized pair), runs them with pytest, and prints pytest's summary.
Rerun it when torchrec moves; docs/torchrec-compat.md keeps the last result and why each failing
test fails.

    python tools/torchrec_suites.py --torchrec-src /path/to/torchrec [-- extra pytest args]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

SUITES = (
    "torchrec/modules/tests/test_embedding_modules.py",
    "torchrec/modules/tests/test_mc_embedding_modules.py",
    "torchrec/modules/tests/test_fp_embedding_modules.py",
    "torchrec/quant/tests/test_embedding_modules.py",
)

SWAP = '''# torchrec's module names pointed at recom_rec's modules before the tests import them.
import torchrec.modules.embedding_modules as float_modules
import torchrec.quant.embedding_modules as quant_modules

import recom_rec
import recom_rec.quant

float_modules.EmbeddingBagCollection = recom_rec.EmbeddingBagCollection
float_modules.EmbeddingCollection = recom_rec.EmbeddingCollection
quant_modules.EmbeddingBagCollection = recom_rec.quant.EmbeddingBagCollection
quant_modules.EmbeddingCollection = recom_rec.quant.EmbeddingCollection


def pytest_collection_finish(session):
    # the swap reached the test modules (else they tested torchrec's own classes)
    for item in session.items:
        for name in ("EmbeddingBagCollection", "EmbeddingCollection"):
            cls = getattr(item.module, name, None)
            assert cls is None or cls.__module__.startswith("recom_rec"), (item.module.__name__, name, cls)
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torchrec-src", required=True, help="a checkout of pytorch/torchrec")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for suite in SUITES:
            source = os.path.join(args.torchrec_src, suite)
            if not os.path.exists(source):
                print(f"not in this checkout: {suite}")
                continue
            # one flat folder: the two test_embedding_modules.py files get their package's name
            name = "test_" + suite.split("/")[1] + "_" + os.path.basename(suite)[len("test_"):]
            shutil.copy(source, os.path.join(tmp, name))
        with open(os.path.join(tmp, "conftest.py"), "w") as f:
            f.write(SWAP)
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", tmp,
                                *args.pytest_args], cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
