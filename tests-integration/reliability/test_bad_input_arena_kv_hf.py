"""Fuzzed bad input to the arena (``ArenaConfig``, ``PinnedArena``, ``Block.tensor``, ``pin_``,
``StagingRing``), the paged KV cache (``KVConfig``/``PagedKVCache``, ``update``, ``gather``) and the
Hugging Face entry points (``load_model``, ``TidalTrainer``).

Each generated value must be refused with a ``ValueError`` / ``TypeError`` / the package's error class whose
message names the option.
"""

from __future__ import annotations

import pytest
import torch
from _fuzz import bad_bool, bad_choice, bad_pos_int, floats_any, fuzz, junk_text, refused
from hypothesis import given
from hypothesis import strategies as st

from tidal_arena import ArenaConfig, PinnedArena, StagingRing, pin_
from tidal_kv import PagedKVCache

pytestmark = pytest.mark.timeout(180)

# ----------------------------------------------------------------- arena

ARENA_VALUES = {
    "backend": bad_choice(("auto", "cupy", "pageable")),
    "slab_bytes": bad_pos_int(none_ok=False),
    "max_pinned_bytes": bad_pos_int(none_ok=True),
    "alignment": st.one_of(
        bad_pos_int(none_ok=False, minimum=16), st.sampled_from([24, 100, 1000, 513, 3 << 10])
    ),
    "on_limit": bad_choice(("error", "pageable")),
    "device": bad_pos_int(none_ok=True, minimum=0),
}


@pytest.mark.parametrize("option", sorted(ARENA_VALUES))
def test_arena_config_option(option, fuzz_count):
    @fuzz(25)
    @given(value=ARENA_VALUES[option])
    def run(value):
        fuzz_count("ArenaConfig(option=...)")
        refused(lambda: ArenaConfig(**{option: value}), option)

    run()


@fuzz(15)
@given(
    config=st.one_of(
        st.integers(), junk_text, st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    )
)
def test_arena_bad_config_object(config, fuzz_count):
    fuzz_count("PinnedArena(config=...)")
    refused(lambda: PinnedArena(config), "config")


@fuzz(40)
@given(nbytes=bad_pos_int(none_ok=False), tag=st.one_of(st.just("t"), st.integers(), st.none()))
def test_arena_alloc(nbytes, tag, fuzz_count):
    fuzz_count("PinnedArena.alloc(...)")
    with PinnedArena(ArenaConfig(backend="pageable", slab_bytes=1 << 16)) as arena:
        refused(lambda: arena.alloc(nbytes, tag=tag), "nbytes")
        refused(lambda: arena.alloc(64, tag=123), "tag")


@fuzz(40)
@given(
    dtype=st.one_of(junk_text, st.integers(), st.none(), st.just(float)),
    shape=st.one_of(
        st.lists(st.integers(-5, -1), min_size=1, max_size=3),
        st.tuples(st.integers(64, 10**6), st.integers(2, 9)),
    ),
)
def test_block_tensor(dtype, shape, fuzz_count):
    fuzz_count("Block.tensor(...)")
    with PinnedArena(ArenaConfig(backend="pageable", slab_bytes=1 << 16)) as arena:
        blk = arena.alloc(256)
        if dtype is not None:
            refused(lambda: blk.tensor(dtype), "dtype")
        refused(lambda: blk.tensor(torch.float32, shape), "shape")
        blk.free()
        refused(lambda: blk.free(), "free", match="freed|free")
        refused(lambda: blk.tensor(torch.uint8), "freed")


@fuzz(20)
@given(obj=st.one_of(st.none(), st.integers(), junk_text, st.just([1.0, 2.0]), st.just(torch.device("meta"))))
def test_pin_not_a_cpu_tensor(obj, fuzz_count):
    fuzz_count("pin_(tensor=...)")
    t = torch.empty(4, device="meta") if isinstance(obj, torch.device) else obj
    refused(lambda: pin_(t), "tensor")


@fuzz(40)
@given(
    which=st.sampled_from(["slots", "slot_bytes", "workers", "device"]),
    value=st.one_of(
        st.integers(max_value=0), floats_any, st.booleans(), st.sampled_from(["tpu", "meta", "", "xla"])
    ),
)
def test_staging_ring(which, value, fuzz_count):
    if which != "device" and isinstance(value, str):
        value = -1
    if which == "device" and not isinstance(value, str):
        value = "mps"
    fuzz_count("StagingRing(...)")
    kw = {"slots": 2, "slot_bytes": 1024, "device": "cpu", which: value}
    refused(lambda: StagingRing(**kw), which)


# ----------------------------------------------------------------- KV cache

KV_VALUES = {
    "num_layers": bad_pos_int(none_ok=False),
    "max_tokens": bad_pos_int(none_ok=False),
    "num_kv_heads": bad_pos_int(none_ok=True),
    "head_dim": bad_pos_int(none_ok=True),
    "batch_size": bad_pos_int(none_ok=True),
    "resident_layers": st.one_of(
        st.integers(max_value=-1),
        junk_text.filter(lambda s: s != "auto"),
        st.lists(st.integers(4, 99), min_size=1, max_size=2),
        floats_any,
    ),
    "page_tokens": bad_pos_int(none_ok=False),
    "vram_budget": bad_pos_int(none_ok=True),
    "vram_fraction": st.one_of(
        st.floats(max_value=0.0),
        st.floats(min_value=1.0, exclude_min=True),
        st.just(float("nan")),
        junk_text,
        st.booleans(),
    ),
    "dtype": st.one_of(
        st.sampled_from([torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn]), junk_text, st.integers()
    ),
    "storage": bad_choice(("native", "fp8")),
    "device": st.sampled_from(["tpu", "", "cpu:zz", "gpu"]),
    "prefetch_slots": st.one_of(
        st.integers().filter(lambda i: i not in (2, 3)), floats_any, junk_text, st.booleans()
    ),
}


@pytest.mark.parametrize("option", sorted(KV_VALUES))
def test_kv_option(option, fuzz_count):
    base = {"num_layers": 4, "max_tokens": 32}

    @fuzz(20)
    @given(value=KV_VALUES[option])
    def run(value):
        fuzz_count("PagedKVCache(option=...)")
        refused(lambda: PagedKVCache(**{**base, option: value}), option)

    run()


@fuzz(60)
@given(
    case=st.sampled_from(["layer", "rank", "mismatch_v", "zero_tokens", "heads", "dtype", "nan"]),
    layer=st.one_of(
        st.integers(max_value=-1), st.integers(min_value=4), junk_text, st.booleans(), floats_any
    ),
)
def test_kv_update(case, layer, fuzz_count):
    """Wrong layer, rank, k/v mismatch, 0 new tokens, head count or dtype against a fixed cache."""
    fuzz_count("PagedKVCache.update(...)")
    cache = PagedKVCache(
        4, 32, num_kv_heads=2, head_dim=8, batch_size=1, dtype=torch.float32, device="cpu", resident_layers=2
    )
    k = torch.randn(1, 2, 3, 8)
    v = torch.randn(1, 2, 3, 8)
    if case == "layer":
        refused(lambda: cache.update(layer, k, v), "layer")
        refused(lambda: cache.gather(layer), "layer")
    elif case == "rank":
        refused(lambda: cache.update(0, k[0], v[0]), "k")
    elif case == "mismatch_v":
        refused(lambda: cache.update(0, k, v[..., :4]), "v")
    elif case == "zero_tokens":
        refused(lambda: cache.update(0, k[:, :, :0], v[:, :, :0]), "token")
    elif case == "heads":
        refused(lambda: cache.update(0, torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8)), "num_kv_heads")
    elif case == "dtype":
        refused(lambda: cache.update(0, k.double(), v.double()), "dtype")
    else:
        # NaN/inf K/V are data, not options: the cache stores them exactly (no crash, no hang)
        k[0, 0, 0, 0] = float("nan")
        v[0, 1, 2, 3] = float("inf")
        for layer_i in range(4):
            ko, vo = cache.update(layer_i, k, v)
            assert torch.equal(ko.nan_to_num(), k.nan_to_num()) and torch.equal(vo, v)


# ----------------------------------------------------------------- Hugging Face entry points

LOAD_VALUES = {
    "quantize": bad_choice((None, "auto", "int8", "nf4", "fp8", "nvfp4")),
    "dtype": st.one_of(st.sampled_from([torch.int8, torch.int64, torch.bool]), junk_text, st.none()),
    "random_weights": bad_bool().filter(lambda v: v is not None),
    "progress": bad_bool(),
    "device": st.sampled_from(["tpu", "", "cpu:zz", "gpu", "xla"]),
}
KNOWN_LOAD: dict[str, str] = {}


@pytest.mark.parametrize("option", sorted(LOAD_VALUES))
def test_load_model_option(option, fuzz_count, request):
    pytest.importorskip("transformers")
    from tidal_hf import load_model, tiny_config

    if option in KNOWN_LOAD:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_LOAD[option]))
    cfg = tiny_config("llama")

    @fuzz(12)
    @given(value=LOAD_VALUES[option])
    def run(value):
        fuzz_count("load_model(option=...)")
        kw = {"random_weights": True, "device": "cpu", "progress": False, option: value}
        refused(lambda: load_model(cfg, **kw), option)

    run()


@fuzz(20)
@given(path=st.from_regex(r"[a-z0-9_]{1,10}", fullmatch=True))
def test_load_model_missing_folder(path, fuzz_count, tmp_path_factory):
    pytest.importorskip("transformers")
    from tidal_hf import load_model

    fuzz_count("load_model(name_or_path=missing)")
    missing = tmp_path_factory.getbasetemp() / "no-such-model" / path
    refused(
        lambda: load_model(str(missing), device="cpu", progress=False),
        "name_or_path",
        match="name_or_path|folder|cache",
    )


def _trainer_parts(tmp_path):
    from transformers import AutoModelForCausalLM, TrainingArguments

    from tidal_hf import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2"))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.arange(i, i + 16) % 128
            return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    return model, args, Data()


TRAINER_VALUES = {
    "offload": st.one_of(junk_text, st.integers(2, 9)),
    "moment_dtype": bad_choice(("fp32", "bf16", "auto")),
    "vram_budget": st.one_of(st.integers(max_value=0), junk_text),
    "bogus_option": st.integers(),
    "loss_chunk_size": st.one_of(st.integers(max_value=0), floats_any, junk_text, st.booleans()),
}


@pytest.mark.parametrize("option", sorted(TRAINER_VALUES))
def test_tidal_trainer_option(option, fuzz_count, tmp_path):
    """A bad tidal option is refused at construction or, at the latest, when the optimizer is created."""
    pytest.importorskip("transformers")
    from tidal_hf import TidalTrainer

    model, args, data = _trainer_parts(tmp_path)

    @fuzz(8)
    @given(value=TRAINER_VALUES[option])
    def run(value):
        fuzz_count("TidalTrainer(...)")
        if option == "loss_chunk_size":
            refused(
                lambda: TidalTrainer(model=model, args=args, train_dataset=data, loss_chunk_size=value),
                option,
            )
            return

        def build_and_create():
            trainer = TidalTrainer(model=model, args=args, train_dataset=data, tidal={option: value})
            try:
                trainer.create_optimizer()
            finally:
                from tidal_stream import unwrap

                target = getattr(trainer, "model", model)
                if hasattr(target, "_tidal_session"):
                    unwrap(target)

        refused(build_and_create, option)

    run()
