"""``recom_rec.EmbeddingBagCollection`` wherever torchrec accepts its own EmbeddingBagCollection:
``isinstance`` and the fields torchrec reads, sharder lookup by type, TorchScript (the module,
and torchrec's trace-then-script inference path), construction under ``with torch.device("meta")``,
torchrec's managed-collision and feature-processed wrappers (training with the fused optimizer,
eval, trace-and-script) and ``swap_modules`` inside them. The checks follow torchrec's own suites
for these modules (torchrec/modules/tests/test_embedding_modules.py, test_mc_embedding_modules.py,
test_fp_embedding_modules.py), with torchrec's module as the reference for every number."""
import io
from typing import List, cast

import pytest
import torch
import torchrec
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.feature_processor_ import (
    FeatureProcessor,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

import recom_rec
from ebc_cases import DEVICE


def _tables(dtypes=(DataType.FP32,)) -> List[EmbeddingBagConfig]:
    """Shared table (two features), a feature read by two tables, mean pooling; one table per
    extra dtype (each dtype is a group of its own: a buffer and a launch)."""
    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=12, feature_names=["f2"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t3", embedding_dim=2, num_embeddings=8, feature_names=["f1"]),
    ]
    for i, dtype in enumerate(dtypes[1:]):
        tables.append(EmbeddingBagConfig(name=f"x{i}", embedding_dim=5, num_embeddings=9, feature_names=["f2"],
                                         data_type=dtype))
    return tables


def _kjt(weighted: bool = False, extra_key: bool = False) -> KeyedJaggedTensor:
    # batch 2; key order differs from the tables' and an unknown key may come along
    keys = ["f2", "f1", "f3"] + (["other"] if extra_key else [])
    lengths = [2, 0, 1, 3, 2, 1] + ([1, 1] if extra_key else [])
    values = [4, 8, 2, 0, 7, 5, 3, 1, 9] + ([99, 98] if extra_key else [])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths),
        weights=torch.linspace(0.2, 1.2, len(values)) if weighted else None,
    ).to(DEVICE)


def _pair(tables_fn=_tables, weighted=False):
    """(ours, torchrec's) with the same weights."""
    ours = recom_rec.EmbeddingBagCollection(tables_fn(), is_weighted=weighted, device=DEVICE)
    theirs = torchrec.EmbeddingBagCollection(tables_fn(), is_weighted=weighted, device=DEVICE)
    with torch.no_grad():
        for name, bag in theirs.embedding_bags.items():
            bag.weight.copy_(ours.embedding_bags[name].weight)
    return ours, theirs


# ------------------------------------------------------------------------------------ isinstance
def test_isinstance_and_the_fields_torchrec_reads():
    ours, theirs = _pair()
    assert isinstance(ours, torchrec.EmbeddingBagCollection)
    assert isinstance(ours, torchrec.modules.embedding_modules.EmbeddingBagCollectionInterface)
    for field in ("_embedding_names", "_lengths_per_embedding", "_feature_names", "_is_weighted"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert [c.name for c in ours.embedding_bag_configs()] == [c.name for c in theirs.embedding_bag_configs()]
    assert ours._embedding_bag_configs is ours.embedding_bag_configs()
    assert ours.is_weighted() == theirs.is_weighted()
    assert ours.device == theirs.device == ours._device
    assert list(ours.embedding_bags) == list(theirs.embedding_bags)
    for name, bag in theirs.embedding_bags.items():
        mine = ours.embedding_bags[name]
        assert isinstance(mine, nn.EmbeddingBag) and mine.mode == bag.mode
        assert mine.weight.shape == bag.weight.shape
    assert list(ours.state_dict()) == list(theirs.state_dict())
    # torchrec's __init__ did not run: no second set of tables anywhere in the module
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


def _sum_tables() -> List[EmbeddingBagConfig]:
    tables = _tables()
    tables[1].pooling = PoolingType.SUM  # torchrec's module rejects weighted mean pooling
    return tables


@pytest.mark.parametrize("weighted", [False, True])
def test_torchrec_reference_outputs_and_shapes(weighted):
    ours, theirs = _pair(_sum_tables if weighted else _tables, weighted=weighted)
    kjt = _kjt(weighted=weighted, extra_key=True)
    a, b = ours(kjt), theirs(kjt)
    assert a.keys() == b.keys() == ["f1@t1", "f3", "f2", "f1@t3"]
    assert a.offset_per_key() == b.offset_per_key()
    torch.testing.assert_close(a.values(), b.values())


def test_duplicate_table_name_fails():
    tables = _tables()
    tables[1].name = "t1"
    with pytest.raises(ValueError, match="Duplicate table name"):
        recom_rec.EmbeddingBagCollection(tables)


def test_sharder_lookup_picks_ours_for_ours_and_torchrecs_for_torchrecs():
    """DistributedModelParallel and the planner find a module's sharder by its exact type."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TorchrecSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.planner.utils import sharder_name

    from recom_rec.distributed import EmbeddingBagCollectionSharder

    ours_sharder = EmbeddingBagCollectionSharder()
    sharders = [ours_sharder, *get_default_sharders()]
    ours, theirs = _pair()
    # DistributedModelParallel keys its sharders by module type, the planner by type name
    for key in (lambda t: t, sharder_name):
        by_type = {key(s.module_type): s for s in sharders}
        assert len(by_type) == len(sharders)  # ours does not shadow torchrec's, nor the reverse
        assert by_type[key(type(ours))] is ours_sharder
        assert isinstance(by_type[key(type(theirs))], TorchrecSharder)
        assert not isinstance(by_type[key(type(theirs))], EmbeddingBagCollectionSharder)
    # torchrec's wrapper sharders delegate the tables to the EBC sharder they are given
    wrapped = _mc_wrapped(recom_rec.EmbeddingBagCollection(_mc_tables(), device=DEVICE))
    mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ours_sharder)
    assert set(mc_sharder.shardable_parameters(wrapped)) == {"t1", "t2"}
    assert set(mc_sharder.sharding_types(DEVICE.type)) <= set(ours_sharder.sharding_types(DEVICE.type))


# ------------------------------------------------------------------------------------ TorchScript
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtypes", [(DataType.FP32,), (DataType.FP32, DataType.FP16, DataType.BF16)],
                         ids=["one_group", "three_groups"])
def test_script_and_trace_then_script_match_eager(weighted, dtypes):
    ebc = recom_rec.EmbeddingBagCollection(_tables(dtypes), is_weighted=weighted, device=DEVICE).eval()
    kjt = _kjt(weighted, extra_key=True)
    with torch.no_grad():
        eager = ebc(kjt)
        for scripted in (torch.jit.script(ebc), torch.jit.script(torchrec.fx.symbolic_trace(ebc))):
            out = scripted(kjt)
            assert out.keys() == eager.keys()
            assert out.offset_per_key() == eager.offset_per_key()
            torch.testing.assert_close(out.values(), eager.values())


def test_scripted_module_saves_loads_and_reads_the_same_weights():
    ebc = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE).eval()
    scripted = torch.jit.script(ebc)
    assert scripted.embedding_bags.t1.weight.data_ptr() == ebc.embedding_bags["t1"].weight.data_ptr()
    # TorchScript does not know buffer persistence: the flat buffers show up in its state_dict too
    assert set(ebc.state_dict()) <= set(scripted.state_dict())
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer, map_location=DEVICE)
    kjt = _kjt()
    with torch.no_grad():
        torch.testing.assert_close(loaded(kjt).values(), ebc(kjt).values())


def test_scripted_module_inside_a_model_and_its_errors():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
            self.proj = nn.Linear(12, 1)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.proj(self.ebc(kjt).values())

    model = Model().to(DEVICE).eval()
    scripted = torch.jit.script(model)
    kjt = _kjt()
    with torch.no_grad():
        torch.testing.assert_close(scripted(kjt), model(kjt))
        missing = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([1, 2]),
                                                      lengths=torch.tensor([1, 0, 0, 1])).to(DEVICE)
        with pytest.raises(Exception, match="missing feature f3"):
            scripted(missing)
        bad = KeyedJaggedTensor.from_lengths_sync(keys=["f2", "f1", "f3"], values=torch.tensor([1, 2, 10]),
                                                  lengths=torch.tensor([1, 0, 0, 1, 1, 0])).to(DEVICE)
        # The torch backend raises in the call; the GPU kernels report it to the scripted module's
        # check_inputs() (an exported method), or its next call; never to another module.
        other = torch.jit.script(Model().to(DEVICE).eval())
        with pytest.raises(Exception, match=r"feature 'f3' \(table 't1'\): id 10"):
            scripted(bad)
            other(kjt)
            other.ebc.check_inputs()
            scripted.ebc.check_inputs()
        other.ebc.check_inputs()
        torch.testing.assert_close(scripted(kjt), model(kjt))


def test_scripting_leaves_the_eager_module_training():
    ebc = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    ebc.enable_fused_optimizer("sgd", lr=0.5)
    torch.jit.script(ebc)  # the fused optimizer is not part of the scripted module
    before = ebc.embedding_bags["t1"].weight.detach().clone()
    ebc(_kjt()).values().sum().backward()
    assert not torch.equal(before, ebc.embedding_bags["t1"].weight)
    assert ebc.fused_optimizer is not None


# ------------------------------------------------------------------------------------ meta
def test_device_from_argument_context_and_default():
    for make in (lambda: recom_rec.EmbeddingBagCollection(_tables(), device=torch.device("meta")),
                 lambda: _in_meta_context(lambda: recom_rec.EmbeddingBagCollection(_tables()))):
        ebc = make()
        assert ebc.device == ebc.embedding_bags["t1"].weight.device == torch.device("meta")
    ebc = recom_rec.EmbeddingBagCollection(_tables())  # no device, no context: torchrec's default
    assert ebc.device == ebc.embedding_bags["t1"].weight.device == torchrec.EmbeddingBagCollection(_tables()).device


def _in_meta_context(build):
    with torch.device("meta"):
        return build()


def test_meta_device_context_then_to_empty():
    with torch.device("meta"):
        ebc = recom_rec.EmbeddingBagCollection(_tables((DataType.FP32, DataType.FP16)), is_weighted=True)
        theirs = torchrec.EmbeddingBagCollection(_tables(), is_weighted=True)
    assert ebc.device == theirs.device == torch.device("meta")
    assert all(p.is_meta for p in ebc.parameters())
    meta_out = ebc(_kjt(weighted=True).to("meta"))  # shapes flow through on meta, as torchrec's
    assert meta_out.values().shape == (2, 17) and meta_out.values().is_meta
    ebc.to_empty(device=DEVICE)
    assert ebc.device == torch.empty(0, device=DEVICE).device  # "cuda" materialises on "cuda:0"
    ebc.reset_parameters()
    ref = recom_rec.EmbeddingBagCollection(_tables((DataType.FP32, DataType.FP16)), is_weighted=True, device=DEVICE)
    ref.load_state_dict(ebc.state_dict())
    kjt = _kjt(weighted=True)
    torch.testing.assert_close(ebc(kjt).values(), ref(kjt).values())
    # the index metadata was built on the host, not left on meta or filled with garbage
    for name, host in ebc._host_index_buffers.items():
        assert torch.equal(getattr(ebc, name).cpu(), host)


# ------------------------------------------------------------------------------------ MC wrapper
SLOTS = 12


def _mc_tables() -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=SLOTS, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=6, num_embeddings=SLOTS, feature_names=["f2"])]


def _mc_wrapped(ebc) -> ManagedCollisionEmbeddingBagCollection:
    configs = ebc.embedding_bag_configs()
    mcc = ManagedCollisionCollection({
        c.name: MCHManagedCollisionModule(zch_size=SLOTS, device=DEVICE, eviction_interval=1, input_hash_size=500,
                                          eviction_policy=DistanceLFU_EvictionPolicy())
        for c in configs}, configs)
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)


def _raw_batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * 4,), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"],
                                               values=torch.randint(0, 500, (int(lengths.sum()),), generator=g),
                                               lengths=lengths).to(DEVICE)


def test_managed_collision_wraps_ours_trains_with_the_fused_optimizer_and_evals():
    torch.manual_seed(0)
    ours = _mc_wrapped(recom_rec.EmbeddingBagCollection(_mc_tables(), device=DEVICE))
    theirs = _mc_wrapped(torchrec.EmbeddingBagCollection(_mc_tables(), device=DEVICE))
    theirs.load_state_dict(ours.state_dict())
    assert ours._embedding_bag_collection is ours._embedding_module
    # torchrec's way of fusing an optimizer: ours runs it in its backward kernel
    for model in (ours, theirs):
        _apply_optimizer_in_backward(torch.optim.Adagrad, model._embedding_module.parameters(), {"lr": 0.2})
    for step in range(4):
        kjt = _raw_batch(step)
        (a, remapped_a), (b, remapped_b) = ours(kjt), theirs(kjt)
        for key in ("f1", "f2"):
            assert torch.equal(remapped_a[key].values(), remapped_b[key].values())
            assert bool((remapped_a[key].values() < SLOTS).all())  # raw ids -> slots of the table
        torch.testing.assert_close(a.values(), b.values())
        a.values().square().sum().backward()
        b.values().square().sum().backward()
    assert ours._embedding_module.fused_optimizer is not None
    for name in ("t1", "t2"):
        torch.testing.assert_close(ours._embedding_module.embedding_bags[name].weight,
                                   theirs._embedding_module.embedding_bags[name].weight)
        assert ours._embedding_module.embedding_bags[name].weight.grad is None  # updated in the backward
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        kjt = _raw_batch(10)
        (a, _), (b, _) = ours(kjt), theirs(kjt)
        torch.testing.assert_close(a.values(), b.values())


# ------------------------------------------------------------------------------------ FP wrapper
def _fp_tables() -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=16, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=16, feature_names=["f2"])]


def _fp_kjt(extra_key: bool = False) -> KeyedJaggedTensor:
    keys = ["f1", "f2"] + (["f3"] if extra_key else [])
    offsets = [0, 2, 2, 3, 4, 5, 8] + ([9, 9, 9] if extra_key else [])
    return KeyedJaggedTensor.from_offsets_sync(keys=keys, values=torch.arange(offsets[-1]),
                                               offsets=torch.tensor(offsets)).to(DEVICE)


def _fp_pair(collection: bool):
    def processors():
        if collection:
            return PositionWeightedModuleCollection({"f1": 10, "f2": 10}, device=DEVICE)
        return {"f1": cast(FeatureProcessor, PositionWeightedModule(max_feature_length=10, device=DEVICE)),
                "f2": cast(FeatureProcessor, PositionWeightedModule(max_feature_length=5, device=DEVICE))}

    ours_ebc, theirs_ebc = _pair(_fp_tables, weighted=True)
    ours = FeatureProcessedEmbeddingBagCollection(ours_ebc, processors())
    theirs = FeatureProcessedEmbeddingBagCollection(theirs_ebc, processors())
    with torch.no_grad():  # position weights that are not all ones
        for model in (ours, theirs):
            for name, p in model.named_parameters():
                if "position_weight" in name:
                    p.copy_(torch.linspace(0.5, 1.5, p.numel()))
    return ours, theirs


@pytest.mark.parametrize("collection", [True, False], ids=["collection", "per_feature"])
def test_feature_processed_wraps_ours_trains_and_evals(collection):
    ours, theirs = _fp_pair(collection)
    for model in (ours, theirs):
        tables = model._embedding_bag_collection.parameters()
        _apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": 0.3})
    dense = {n: p for n, p in ours.named_parameters() if "position_weight" in n}
    assert dense, "position weights are trained by an ordinary optimizer"
    for step in range(3):
        kjt = _fp_kjt(extra_key=step == 1)
        a, b = ours(kjt), theirs(kjt)
        assert a.keys() == b.keys() == ["f1", "f2"]
        assert a.offset_per_key() == [0, 8, 16]
        torch.testing.assert_close(a.values(), b.values())
        a.values().square().sum().backward()
        b.values().square().sum().backward()
        mine, ref = dict(ours.named_parameters()), dict(theirs.named_parameters())
        for name in dense:
            torch.testing.assert_close(mine[name].grad, ref[name].grad, msg=name)
            mine[name].grad = ref[name].grad = None
    for name in ("t1", "t2"):
        torch.testing.assert_close(ours._embedding_bag_collection.embedding_bags[name].weight,
                                   theirs._embedding_bag_collection.embedding_bags[name].weight)
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_fp_kjt()).values(), theirs(_fp_kjt()).values())


def test_feature_processed_trace_then_script():
    ours, _ = _fp_pair(collection=True)
    ours.eval()
    kjt = _fp_kjt()
    scripted = torch.jit.script(torchrec.fx.symbolic_trace(ours))
    with torch.no_grad():
        eager = ours(kjt)
        out = scripted(kjt)
    torch.testing.assert_close(out.values(), eager.values())
    assert out.offset_per_key() == eager.offset_per_key()


# ------------------------------------------------------------------------------------ swap
def test_swap_modules_reaches_inside_the_wrappers():
    torch.manual_seed(0)
    mc = _mc_wrapped(torchrec.EmbeddingBagCollection(_mc_tables(), device=DEVICE))
    fp = FeatureProcessedEmbeddingBagCollection(
        torchrec.EmbeddingBagCollection(_fp_tables(), is_weighted=True, device=DEVICE),
        PositionWeightedModuleCollection({"f1": 10, "f2": 10}, device=DEVICE))
    model = nn.ModuleDict({"mc": mc, "fp": fp})
    mc_kjt = _raw_batch(0)
    with torch.no_grad():
        # the MC module's state moves with its inputs: compare on a copy of it
        import copy

        before_mc = copy.deepcopy(mc)(mc_kjt)[0].values()
        before_fp = fp(_fp_kjt()).values()
    swapped = recom_rec.swap_modules(model)
    assert swapped is model
    assert type(model["mc"]._embedding_module) is recom_rec.EmbeddingBagCollection
    assert type(model["fp"]._embedding_bag_collection) is recom_rec.EmbeddingBagCollection
    assert model["mc"]._embedding_bag_collection is model["mc"]._embedding_module
    with torch.no_grad():
        torch.testing.assert_close(model["mc"](mc_kjt)[0].values(), before_mc)
        torch.testing.assert_close(model["fp"](_fp_kjt()).values(), before_fp)


def test_reset_optimizer_rows_puts_the_fused_state_back():
    """What the sharded managed-collision module's eviction calls (through the lookup) for the
    slots it gives to new ids."""
    ebc = recom_rec.EmbeddingBagCollection(_tables(), device=DEVICE)
    ebc.enable_fused_optimizer("adagrad", lr=0.1, initial_accumulator_value=0.25)
    ebc(_kjt()).values().sum().backward()
    state = ebc.embedding_bags["t1"].optimizer_sum
    touched = (state != 0.25).any(dim=1).nonzero().flatten()
    assert touched.numel() >= 2
    ebc.reset_optimizer_rows("t1", touched[:1])
    assert bool((state[touched[0]] == 0.25).all())
    assert bool((state[touched[1]] != 0.25).any())


def test_parameter_server_tables_refuse_torchscript_and_fx_with_a_clear_error():
    import uuid

    from recom_rec.ps import PSConfig

    ebc = recom_rec.EmbeddingBagCollection(
        _tables(), device=DEVICE, ps={"t2": PSConfig(f"memory://compat-{uuid.uuid4().hex}", cache_rows=12)})
    with pytest.raises(ValueError, match="parameter-server tables .* does not support TorchScript"):
        torch.jit.script(ebc)
    with pytest.raises(ValueError, match="parameter-server tables .* does not support fx tracing"):
        torchrec.fx.symbolic_trace(ebc)
