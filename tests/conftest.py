import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# Kernels are compared on random shapes; individual examples can be slow under the Triton
# interpreter, so no per-example deadline. CI runs the "ci" profile.
settings.register_profile(
    "ci", deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
