"""The model zoo: the Hugging Face and TIMM model lists that PyTorch's own compiler is judged by
(pytorch/pytorch, benchmarks/dynamo/huggingface_models_list.txt and timm_models_list.txt), each
built with random weights from its config (no download), shrunk where the config allows (2
layers, small widths) with its code paths unchanged, compiled for 2 stages (`--measure off`) and
1, and trained 2 steps on 2 processes and on 1. A model passes when both train to the same
losses (relative 1e-4, `--rel-tol`); every other ends in a class: a clear pipec error (one line,
exit 2), a traceback, a training failure, different losses, or a timeout. `--schedule zbv` runs
the 2 stages as ZB-V (4 stages on 2 devices, the zero-bubble split backward) at micro-batch 2,
4 micro-batches a step: the schedule where a stage's weights and inputs get their gradients
apart.

Run it where timm loads (torch 2.14.1 beside torchvision 0.29.1; `make test-torch` builds that
venv), one model at a time (2 cores):

    OMP_NUM_THREADS=1 .venv-torch-2.14.1/bin/python benchmarks/zoo.py
    .venv-torch-2.14.1/bin/python benchmarks/zoo.py --only BertForMaskedLM ghostnet_100
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zoo.py --suite huggingface --schedule zbv \
        --rel-tol 1e-6 --out benchmarks/results/zoo-zbv.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tabulate import tabulate
from zoo_models import timm_model, write

RESULTS = Path(__file__).resolve().parent / "results"
# The lists as of pytorch/pytorch 0fb2b95 (Hugging Face) and 06d9861 (TIMM): the name in the
# list, then the transformers class and the task whose inputs and loss it takes.
HUGGING_FACE = (
    ("AlbertForMaskedLM", "AlbertForMaskedLM", "masked"),
    ("AlbertForQuestionAnswering", "AlbertForQuestionAnswering", "qa"),
    ("AllenaiLongformerBase", "LongformerForMaskedLM", "masked"),
    ("BartForCausalLM", "BartForCausalLM", "causal"),
    ("BartForConditionalGeneration", "BartForConditionalGeneration", "seq2seq"),
    ("BertForMaskedLM", "BertForMaskedLM", "masked"),
    ("BertForQuestionAnswering", "BertForQuestionAnswering", "qa"),
    ("BlenderbotForCausalLM", "BlenderbotForCausalLM", "causal"),
    ("BlenderbotForConditionalGeneration", "BlenderbotForConditionalGeneration", "seq2seq"),
    ("BlenderbotSmallForCausalLM", "BlenderbotSmallForCausalLM", "causal"),
    ("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallForConditionalGeneration",
     "seq2seq"),
    ("CamemBert", "CamembertForMaskedLM", "masked"),
    ("DebertaV2ForMaskedLM", "DebertaV2ForMaskedLM", "masked"),
    ("DebertaV2ForQuestionAnswering", "DebertaV2ForQuestionAnswering", "qa"),
    ("DistilBertForMaskedLM", "DistilBertForMaskedLM", "masked"),
    ("DistilBertForQuestionAnswering", "DistilBertForQuestionAnswering", "qa"),
    ("DistillGPT2", "GPT2LMHeadModel", "causal"),
    ("ElectraForCausalLM", "ElectraForCausalLM", "causal"),
    ("ElectraForQuestionAnswering", "ElectraForQuestionAnswering", "qa"),
    ("GPT2ForSequenceClassification", "GPT2ForSequenceClassification", "classify"),
    ("GPTJForCausalLM", "GPTJForCausalLM", "causal"),
    ("GPTJForQuestionAnswering", "GPTJForQuestionAnswering", "qa"),
    ("GPTNeoForCausalLM", "GPTNeoForCausalLM", "causal"),
    ("GPTNeoForSequenceClassification", "GPTNeoForSequenceClassification", "classify"),
    ("GoogleFnet", "FNetForMaskedLM", "masked"),
    ("LayoutLMForMaskedLM", "LayoutLMForMaskedLM", "masked"),
    ("LayoutLMForSequenceClassification", "LayoutLMForSequenceClassification", "classify"),
    ("M2M100ForConditionalGeneration", "M2M100ForConditionalGeneration", "seq2seq"),
    ("MBartForCausalLM", "MBartForCausalLM", "causal"),
    ("MBartForConditionalGeneration", "MBartForConditionalGeneration", "seq2seq"),
    ("MT5ForConditionalGeneration", "MT5ForConditionalGeneration", "seq2seq"),
    ("MegatronBertForCausalLM", "MegatronBertForCausalLM", "causal"),
    ("MegatronBertForQuestionAnswering", "MegatronBertForQuestionAnswering", "qa"),
    ("MobileBertForMaskedLM", "MobileBertForMaskedLM", "masked"),
    ("MobileBertForQuestionAnswering", "MobileBertForQuestionAnswering", "qa"),
    ("OPTForCausalLM", "OPTForCausalLM", "causal"),
    ("PLBartForCausalLM", "PLBartForCausalLM", "causal"),
    ("PLBartForConditionalGeneration", "PLBartForConditionalGeneration", "seq2seq"),
    ("PegasusForCausalLM", "PegasusForCausalLM", "causal"),
    ("PegasusForConditionalGeneration", "PegasusForConditionalGeneration", "seq2seq"),
    ("RobertaForCausalLM", "RobertaForCausalLM", "causal"),
    ("RobertaForQuestionAnswering", "RobertaForQuestionAnswering", "qa"),
    ("T5ForConditionalGeneration", "T5ForConditionalGeneration", "seq2seq"),
    ("T5Small", "T5ForConditionalGeneration", "seq2seq"),
    ("TrOCRForCausalLM", "TrOCRForCausalLM", "causal"),
    ("XGLMForCausalLM", "XGLMForCausalLM", "causal"),
    ("XLNetLMHeadModel", "XLNetLMHeadModel", "causal"),
    ("YituTechConvBert", "ConvBertForMaskedLM", "masked"),
    ("meta-llama/Llama-3.2-1B", "LlamaForCausalLM", "causal"),
    ("google/gemma-2-2b", "Gemma2ForCausalLM", "causal"),
    ("google/gemma-3-4b-it", "Gemma3ForConditionalGeneration", "causal"),
    ("openai/whisper-tiny", "WhisperForConditionalGeneration", "speech"),
    ("Qwen/Qwen3-0.6B", "Qwen3ForCausalLM", "causal"),
    ("mistralai/Mistral-7B-Instruct-v0.3", "MistralForCausalLM", "causal"),
    ("openai/gpt-oss-20b", "GptOssForCausalLM", "causal"),
)
TIMM = ("adv_inception_v3", "beit_base_patch16_224", "convnextv2_nano.fcmae_ft_in22k_in1k",
        "deit_base_distilled_patch16_224", "deit_tiny_patch16_224.fb_in1k", "dm_nfnet_f0",
        "ghostnet_100", "inception_v3", "mobilenetv2_100", "mobilenetv3_large_100",
        "mobilevit_s", "nfnet_l0", "repvgg_a2", "swin_base_patch4_window7_224",
        "tf_efficientnet_b0", "visformer_small", "vit_base_patch14_dinov2.lvd142m",
        "vit_base_patch16_siglip_256")

VOCAB, LENGTH = 512, 16
# Config fields set wherever a config has them: 2 layers, width 64, 2 heads.
SHRINK = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2, "hidden_size": 64, "d_model": 64,
    "n_embd": 64, "embedding_size": 64, "num_attention_heads": 2, "n_head": 2, "num_heads": 2,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "attention_heads": 2,
    "num_key_value_heads": 1, "intermediate_size": 128, "ffn_dim": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "d_ff": 128, "d_inner": 128,
    "n_inner": 128, "d_kv": 32, "head_dim": 32, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
    "intra_bottleneck_size": 64, "true_hidden_size": 64, "word_embed_proj_dim": 64,
    "rotary_dim": 16, "attention_window": 8, "num_mel_bins": 16, "max_source_positions": 16,
    "max_target_positions": 64, "use_cache": False, "num_labels": 2,
}
# What a shrunk config needs besides, by class.
OVERRIDES: dict[str, dict[str, object]] = {
    "GPTNeoForCausalLM": {"attention_types": [[["global", "local"], 1]]},
    "GPTNeoForSequenceClassification": {"attention_types": [[["global", "local"], 1]]},
}
TASK_INPUTS = {
    "causal": ("input_ids",), "masked": ("input_ids",), "qa": ("input_ids",),
    "classify": ("input_ids",), "seq2seq": ("input_ids", "decoder_input_ids"),
    "speech": ("input_features", "decoder_input_ids"),
}
LOSSES = {
    "qa": "return (F.cross_entropy(output.start_logits, targets[:, 0])\n"
          "            + F.cross_entropy(output.end_logits, targets[:, 1]))",
    "classify": "return F.cross_entropy(output.logits, targets)",
}
TOKEN_LOSS = "return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())"

HF_SOURCE = '''"""{name} from Hugging Face transformers ({cls}), random weights, a shrunk config."""

import torch
import transformers
from torch import nn
from torch.nn import functional as F

VOCAB, LENGTH = {vocab}, {length}
CONFIG = {config!r}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.{cls}(transformers.{config_cls}(**CONFIG))

    def forward(self, {parameters}):
        return self.model({arguments})


def build_model() -> nn.Module:
    return Model()


def sample_batch(batch_size: int):
    generator = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(3, VOCAB, (batch_size, LENGTH + 1), generator=generator)
{inputs}


def loss_fn(output, targets):
    {loss}
'''
INPUT_SOURCE = {
    "causal": "    return tokens[:, :-1], tokens[:, 1:]",
    "masked": "    return tokens[:, :-1], tokens[:, 1:]",
    "qa": "    return tokens[:, :-1], torch.randint(0, LENGTH, (batch_size, 2), "
          "generator=generator)",
    "classify": "    return tokens[:, :-1], torch.randint(0, 2, (batch_size,), "
                "generator=generator)",
    "seq2seq": "    return (tokens[:, :-1], tokens[:, :-1].roll(1, 1)), tokens[:, 1:]",
    "speech": "    features = torch.randn(batch_size, 16, 32, generator=generator)\n"
              "    return (features, tokens[:, :-1]), tokens[:, 1:]",
}


@dataclass(frozen=True)
class Outcome:
    suite: str
    model: str
    result: str  # "pass", "error" (pipec's one-line error), "traceback", "train", "losses",
    # "timeout" or "build" (the model cannot be built from its shrunk config)
    detail: str
    seconds: float


def shrunk_config(config_class: type, overrides: dict[str, object]) -> dict[str, object]:
    """The SHRINK fields the config has, dropout off, token ids inside the vocabulary, and
    each sub-config (a multimodal model's text and vision parts) shrunk alike."""
    defaults = config_class().to_dict()
    return {**_shrunk_fields(defaults), **overrides}


def _shrunk_fields(defaults: dict[str, object]) -> dict[str, object]:
    fields: dict[str, object] = {k: v for k, v in SHRINK.items() if k in defaults}
    for key, value in defaults.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or "layerdrop" in key):
            fields[key] = 0.0
        elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            fields[key] = 2
        elif key.endswith("_config") and isinstance(value, dict):
            fields[key] = {**value, **_shrunk_fields(value)}
        elif key == "layer_types" and isinstance(value, list):
            fields[key] = value[:2]
    return fields


def hugging_face_source(name: str, cls: str, task: str) -> str:
    import transformers

    model_class = getattr(transformers, cls)
    # A sequence classifier reads the last token before the padding: it needs a pad token id
    # (none of the sampled tokens, which start at 3).
    task_fields = {"pad_token_id": 0} if task == "classify" else {}
    config = shrunk_config(model_class.config_class, {**task_fields, **OVERRIDES.get(cls, {})})
    names = TASK_INPUTS[task]
    return HF_SOURCE.format(
        name=name, cls=cls, config_cls=model_class.config_class.__name__, vocab=VOCAB,
        length=LENGTH, config=config, parameters=", ".join(names),
        arguments=", ".join(f"{n}={n}" for n in names), inputs=INPUT_SOURCE[task],
        loss=LOSSES.get(task, TOKEN_LOSS))


def timm_source(name: str) -> str:
    """The model at a small image size, its transformer families at depth 2."""
    base = name.split(".")[0]
    size = 96 if "inception" in base else 56 if "patch14" in base else 64
    kwargs: dict[str, object] = {}
    if base.startswith(("vit_", "deit_", "beit_")):
        kwargs = {"img_size": size, "depth": 2}
    elif base.startswith("visformer"):
        kwargs = {"img_size": size}
    elif base.startswith("swin_"):
        # Stochastic depth off (its default here is 0.1), as dropout is for the other models:
        # random draws would differ between one process and a pipeline.
        size, kwargs = 224, {"embed_dim": 32, "depths": (1, 1, 1, 1), "num_heads": (1, 2, 4, 8),
                             "drop_path_rate": 0.0}
    elif base.startswith("convnext"):
        kwargs = {"depths": (1, 1, 1, 1)}
    return timm_model(base, size, **kwargs)


@dataclass(frozen=True)
class Settings:
    """How each model runs: the 2-stage plan's schedule, the loss tolerance, the time limit."""

    schedule: str | None = None  # None: pipec's choice
    rel_tol: float = 1e-4
    timeout: float = 300.0

    def pipeline_flags(self, gpus: int) -> list[str]:
        if gpus == 1 or self.schedule is None:
            return []
        return ["--schedule", self.schedule, "--micro-batch", "2"]


def run_one(suite: str, name: str, source: str, workdir: Path, settings: Settings) -> Outcome:
    started = time.perf_counter()
    timeout = settings.timeout
    slug = re.sub(r"\W", "_", name)
    model = write(source, workdir, slug)
    losses = []
    for gpus in (1, 2):
        out = workdir / f"{slug}-{gpus}"
        compiled = _command([_tool("pipec"), "compile", str(model), "--gpus", str(gpus),
                             "--pp", str(gpus), "--hardware", "cpu", "--batch-size", "8",
                             "--measure", "off", "--norm", "group", "-o", str(out), "--force",
                             *settings.pipeline_flags(gpus)], timeout)
        if compiled is None:
            return Outcome(suite, name, "timeout", "pipec compile", _since(started))
        if compiled.returncode:
            return Outcome(suite, name, *_compile_failure(compiled), _since(started))
        trained = _command([_tool("torchrun"), "--standalone", "--nproc_per_node", str(gpus),
                            str(out / "train.py"), "--steps", "2", "--seed", "3"], timeout)
        if trained is None:
            return Outcome(suite, name, "timeout", f"training on {gpus}", _since(started))
        if trained.returncode:
            return Outcome(suite, name, "train", _last_error(trained.stderr), _since(started))
        losses.append([float(v) for v in re.findall(r"^step \d+ loss (\S+)", trained.stdout,
                                                    re.MULTILINE)])
    same = len(losses[0]) == 2 and all(
        math.isclose(a, b, rel_tol=settings.rel_tol) for a, b in zip(*losses, strict=True))
    detail = f"losses {losses[0]} and {losses[1]}"
    return Outcome(suite, name, "pass" if same else "losses", detail, _since(started))


def _compile_failure(compiled: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    lines = [line for line in compiled.stderr.splitlines() if line.startswith("pipec: error:")]
    if compiled.returncode == 2 and lines:
        if "build_model() raised" in lines[-1]:
            return "build", lines[-1][:300]
        return "error", lines[-1][:300]
    return "traceback", _last_error(compiled.stderr)


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if re.match(r"^\w*(Error|Exception)", line)]
    return (lines[-1] if lines else stderr.strip().splitlines()[-1] if stderr.strip() else "")[:300]


def _command(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "PIPEC_MEASURE": "off"})
    except subprocess.TimeoutExpired:
        return None


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 1)


def cases(only: list[str], suites: list[str]) -> list[tuple[str, str, str]]:
    """(suite, name, model file source) for each model of ``suites``, or those ``only`` names."""
    everything = [("huggingface", name, f"{cls}:{task}") for name, cls, task in HUGGING_FACE]
    everything += [("timm", name, "") for name in TIMM]
    return [c for c in everything if (not only or c[1] in only) and c[0] in suites]


def source_of(suite: str, name: str, spec: str) -> str:
    if suite == "timm":
        return timm_source(name)
    cls, task = spec.split(":")
    return hugging_face_source(name, cls, task)


def report(outcomes: list[Outcome], settings: Settings) -> str:
    lines = ["# Model zoo: PyTorch's compiler benchmark lists through pipec", "",
             "Written by `benchmarks/zoo.py` (its docstring says how each model is built and "
             f"judged): 2 stages under {settings.schedule or 'the schedule pipec picks'}, "
             f"losses within relative {settings.rel_tol:g} of one process.", ""]
    for suite in ("huggingface", "timm"):
        mine = [o for o in outcomes if o.suite == suite]
        if mine:
            passed = sum(o.result == "pass" for o in mine)
            lines.append(f"- {suite}: **{passed} of {len(mine)}** pass ({passed / len(mine):.0%})")
    rows = [(o.suite, o.model, o.result, f"{o.seconds:.0f}", o.detail) for o in outcomes]
    return "\n".join([*lines, "", tabulate(rows, ("suite", "model", "result", "s", "detail"),
                                            tablefmt="github"), ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="model names from the lists")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument("--out", type=Path, default=RESULTS / "zoo.md")
    parser.add_argument("--suite", nargs="*", choices=("huggingface", "timm"),
                        default=["huggingface", "timm"])
    parser.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zbv"),
                        help="the 2-stage plan's schedule (default: pipec's choice)")
    parser.add_argument("--rel-tol", type=float, default=1e-4,
                        help="relative loss difference that still passes")
    args = parser.parse_args()
    settings = Settings(args.schedule, args.rel_tol, args.timeout)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="pipec-zoo-") as workdir:
        for suite, name, spec in cases(args.only, args.suite):
            try:
                source = source_of(suite, name, spec)
            except Exception as exc:  # the config cannot be shrunk: the benchmark's failure
                outcome = Outcome(suite, name, "build", f"{type(exc).__name__}: {exc}"[:300], 0)
            else:
                outcome = run_one(suite, name, source, Path(workdir), settings)
            outcomes.append(outcome)
            print(f"{suite:12} {name:45} {outcome.result:9} {outcome.seconds:6.0f}s "
                  f"{outcome.detail[:120]}", flush=True)
    args.out.write_text(report(outcomes, settings))
    args.out.with_suffix(".json").write_text(
        json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
