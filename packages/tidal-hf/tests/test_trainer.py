"""TidalTrainer against transformers' Trainer with torch AdamW, checkpoints and bad options."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from tidal_hf import TidalTrainer
from tidal_hf.errors import OptionError

_spec = importlib.util.spec_from_file_location(
    "tidal_hf_conftest", pathlib.Path(__file__).with_name("conftest.py")
)
_conf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conf)
make_tiny = _conf.make_tiny

# fp32 model, 20 optimizer steps: the chunked loss and the host-side norm differ from the reference only in
# fp32 summation order, which Adam's normalisation can amplify to a few 1e-7 on a weight
PARITY = 2e-6


class _Data(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 40, t: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, t), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[:3] = -100
        return {"input_ids": self.ids[i], "labels": labels, "attention_mask": torch.ones_like(self.ids[i])}


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        adam_beta1=0.85,
        adam_beta2=0.99,
        adam_epsilon=1e-7,
        max_grad_norm=0.5,
        lr_scheduler_type="linear",
        warmup_steps=3,
        max_steps=20,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=7,
        data_seed=7,
        optim="adamw_torch",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _train(cls, arch, tmp_path, extra=None, **kw):
    from transformers import Trainer

    model = make_tiny(arch, seed=5)
    args = _args(tmp_path, **kw)
    trainer_kw = {} if cls is Trainer else (extra or {})
    trainer = cls(model=model, args=args, train_dataset=_Data(model.config.vocab_size), **trainer_kw)
    trainer.train()
    return model, trainer


_REFERENCE: dict[str, dict] = {}


def _reference(arch, tmp_path):
    from transformers import Trainer

    if arch not in _REFERENCE:
        _REFERENCE[arch] = _train(Trainer, arch, tmp_path / "ref")[0].state_dict()
    return _REFERENCE[arch]


@pytest.mark.parametrize("offload", [True, pytest.param(False, id="device-adamw")])
def test_matches_trainer_adamw(arch, tmp_path, offload):
    if not offload and arch != "llama":
        pytest.skip("the device-AdamW path is architecture-independent: checked on llama")
    ref = _reference(arch, tmp_path)
    got, trainer = _train(TidalTrainer, arch, tmp_path / "tidal", {"tidal": {"offload": offload}})
    worst = max((a - b).abs().max().item() for a, b in zip(ref.values(), got.state_dict().values()))
    assert worst < PARITY
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all("tidal/pinned_gib" in h and "grad_norm" in h for h in logs)
    assert any("tidal/h2d_gbps" in h for h in logs)


def test_resume_is_bit_exact(tmp_path):
    full, _ = _train(TidalTrainer, "llama", tmp_path / "full", {"tidal": {"offload": True}}, max_steps=8)
    _train(
        TidalTrainer,
        "llama",
        tmp_path / "ck",
        {"tidal": {"offload": True}},
        max_steps=8,
        save_steps=4,
        save_strategy="steps",
    )
    from transformers import TrainingArguments

    model = make_tiny("llama", seed=5)
    args = _args(tmp_path / "ck", max_steps=8, save_steps=4, save_strategy="steps")
    assert isinstance(args, TrainingArguments)
    trainer = TidalTrainer(
        model=model, args=args, train_dataset=_Data(model.config.vocab_size), tidal={"offload": True}
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "ck" / "checkpoint-4"))
    for (n, a), b in zip(full.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n


def test_bad_options(tmp_path):
    model = make_tiny("gpt2")
    data = _Data(model.config.vocab_size)
    with pytest.raises(OptionError, match="fp16"):
        TidalTrainer(model=model, args=_args(tmp_path, fp16=True, use_cpu=False), train_dataset=data)
    with pytest.raises(OptionError, match="max_grad_norm"):
        TidalTrainer(model=model, args=_args(tmp_path), train_dataset=data, tidal={"max_grad_norm": 1.0})
    with pytest.raises(OptionError, match="loss_chunk_size"):
        TidalTrainer(model=model, args=_args(tmp_path), train_dataset=data, loss_chunk_size=0)
    trainer = TidalTrainer(model=model, args=_args(tmp_path, optim="sgd"), train_dataset=data)
    with pytest.raises(OptionError, match="optim"):
        trainer.train()


def _lora_quant_model(device, seed=5):
    from peft import get_peft_model

    from tidal_hf import lora_config
    from tidal_quant import quantize_model_

    model = make_tiny("llama", seed=seed, hidden_size=128, intermediate_size=256).to(device)
    quantize_model_(model, "nf4", filter=lambda n, m: n.startswith("model.layers."))
    cfg = lora_config(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    return get_peft_model(model, cfg)


def _lora_parity(tmp_path, device, tol):
    from transformers import Trainer

    runs = {}
    for cls, extra in ((Trainer, {}), (TidalTrainer, {"tidal": {"offload": True}})):
        model = _lora_quant_model(device)
        frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
        args = _args(tmp_path / cls.__name__, use_cpu=device == "cpu", max_steps=10)
        args._n_gpu = min(args.n_gpu, 1)  # the reference on one GPU too, not DataParallel over all
        trainer = cls(model=model, args=args, train_dataset=_Data(model.config.vocab_size), **extra)
        trainer.train()
        state = model.state_dict()
        assert all(torch.equal(v, state[k]) for k, v in frozen.items())  # the quantized base never moves
        runs[cls.__name__] = {k: v.float().cpu() for k, v in state.items() if "lora_" in k}
    ref, got = runs["Trainer"], runs["TidalTrainer"]
    assert ref.keys() == got.keys() and ref
    worst = max((ref[k] - got[k]).abs().max().item() for k in ref)
    assert worst < tol, worst


def test_lora_on_quant_matches_trainer(tmp_path):
    _lora_parity(tmp_path, "cpu", PARITY)


@pytest.mark.gpu
def test_lora_on_quant_matches_trainer_cuda(tmp_path):
    # fp32 model on CUDA (TF32 off by default): only summation order differs from the reference
    _lora_parity(tmp_path, "cuda", 1e-5)


def test_one_process_trains_on_one_gpu(tmp_path, caplog):
    """Several visible GPUs without torchrun: no nn.DataParallel around the wrapped model."""
    model = make_tiny("llama", seed=5)
    args = _args(tmp_path, max_steps=1)
    args._n_gpu = 2  # as TrainingArguments reports on a 2-GPU machine
    with caplog.at_level("WARNING", logger="tidal_hf.trainer"):
        trainer = TidalTrainer(model=model, args=args, train_dataset=_Data(model.config.vocab_size))
    assert trainer.args.n_gpu == 1 and args.n_gpu == 2  # the caller's arguments are left as given
    assert "2 GPUs visible in one process" in caplog.text
    trainer.train()
    assert not isinstance(trainer.model_wrapped, torch.nn.DataParallel)


def test_a_split_model_is_not_moved_whole_to_the_gpu(tmp_path, monkeypatch):
    """A model load_model split between host and GPU stays split (wrap() places it); others move as usual."""
    from transformers import Trainer

    import tidal_hf.trainer as tr

    model = make_tiny("llama", seed=5)
    trainer = TidalTrainer(model=model, args=_args(tmp_path, max_steps=1), train_dataset=_Data(64))
    moved = []
    monkeypatch.setattr(Trainer, "_move_model_to_device", lambda self, m, d: moved.append(d))
    monkeypatch.setattr(tr, "_split_host_device", lambda m: True)
    trainer._move_model_to_device(model, torch.device("cuda"))
    assert moved == []  # split: left in place
    trainer._move_model_to_device(model, torch.device("cpu"))
    monkeypatch.setattr(tr, "_split_host_device", lambda m: False)
    trainer._move_model_to_device(model, torch.device("cuda"))
    assert moved == [torch.device("cpu"), torch.device("cuda")]


def test_split_host_device_reads_the_tensor_devices():
    from tidal_hf.trainer import _split_host_device

    model = make_tiny("llama", seed=5)
    assert not _split_host_device(model)  # all on the host
    model.model.layers[0].to("meta")
    assert not _split_host_device(model)  # meta is neither host nor GPU memory


@pytest.mark.gpu
def test_split_model_keeps_its_host_blocks_on_cuda(tmp_path):
    model = make_tiny("llama", seed=5).cuda()
    host_block = model.model.layers[0]
    for p in host_block.parameters():
        p.data = p.data.cpu().pin_memory()  # as load_model leaves a streamed block
    TidalTrainer(model=model, args=_args(tmp_path, use_cpu=False, max_steps=1), train_dataset=_Data(64))
    assert all(p.device.type == "cpu" for p in host_block.parameters())
    assert model.model.embed_tokens.weight.device.type == "cuda"


def test_user_optimizer(tmp_path):
    from transformers import Trainer

    def run(cls, with_scheduler=False):
        model = make_tiny("mistral", seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if with_scheduler else None
        args = _args(tmp_path / cls.__name__, max_steps=6, gradient_accumulation_steps=1)
        cls(model=model, args=args, train_dataset=_Data(128), optimizers=(opt, sched)).train()
        return model.state_dict()

    ref, got = run(Trainer), run(TidalTrainer)
    assert max((ref[k] - got[k]).abs().max().item() for k in ref) < PARITY
    with pytest.raises(OptionError, match="optimizers"):
        run(TidalTrainer, with_scheduler=True)


def test_full_loss_when_the_head_is_adapted(tmp_path, caplog):
    from peft import get_peft_model

    from tidal_hf import lora_config

    model = make_tiny("llama", seed=5)
    model = get_peft_model(model, lora_config(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    args = _args(tmp_path, max_steps=2)
    trainer = TidalTrainer(model=model, args=args, train_dataset=_Data(128))
    with caplog.at_level("WARNING", logger="tidal_hf.trainer"):
        trainer.train()
    assert "full-logits" in caplog.text and "nn.Linear" in trainer._chunked_refused
