"""Pipelining a model over a node's ranks with torch's ``torch.distributed.pipelining``: the compute side of
a pipelined node (``worker serve --node-mode pipeline``).

Rank r of N holds stage r: a contiguous run of the model's blocks, the first stage also the embedding and
the last the final norm and the output head (``stage_blocks`` says which). A stage is the model itself,
built on the meta device and pruned to the stage's modules (``stage_model``), so its parameters keep the
whole model's names and only the stage's are ever allocated; the model does not know it is split. What a
family of models is made of is a ``Layout``: the built-in GPT's and the Hugging Face Llama family's
(``LlamaForCausalLM`` and the models of its shape: Qwen2, Mistral) are known; any other model is refused
with the families that are.

A schedule (``SCHEDULES``: GPipe or 1F1B) runs the node's whole batch through the stages in
``--pipeline-microbatches`` micro-batches; every rank gets every row (stage 0 reads the tokens, the last
stage the targets). A tied input/output embedding lives on the first and the last stage: its two gradients
are summed between them after every backward, so both copies step alike (``PipelineRunner``).

``StageReplica`` is a replica of one stage: it replays updates on the stage's tensors, encodes (owns) the
stage's tensors (a tied one: the first stage), and fingerprints the whole model with one collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gradwire.compression import CodecConfig, GradientCodec
from gradwire.compression.fragment import Fragment
from gradwire.models import GPT
from gradwire.models.gpt import rope_tables
from gradwire.optim.outer import UpdateRule
from gradwire.replica import Fingerprint, Replica, moments, sample_positions, takes_moments
from gradwire.worker.nodeconf import PIPELINE_SCHEDULES

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
assert tuple(sorted(SCHEDULES)) == tuple(sorted(PIPELINE_SCHEDULES)), "placement names the schedules"


# ------------------------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a family of models keeps its parts (dotted module paths) and how a stage runs them."""

    family: str
    embed: tuple[str, ...]  # the first stage's modules before the blocks
    blocks: str  # the ModuleList of repeated blocks
    head: tuple[str, ...]  # the last stage's modules after the blocks
    # (stage module, input: token ids on the first stage, hidden states elsewhere) -> hidden states, or
    # logits on the last stage
    forward: Callable[[StageModule, torch.Tensor], torch.Tensor]
    # computes, on a materialized stage, the buffers the model derives from its config (RoPE tables)
    derive_buffers: Callable[[nn.Module], None]


def _gpt_forward(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    model = stage.model
    if stage.first:
        x = model.tok_emb(x)  # (B, T, C)
    cos, sin = model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]]
    for block in model.blocks.values():
        x = block(x, cos, sin)
    return model.lm_head(model.norm(x)) if stage.last else x


def _llama_forward(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    model = stage.model
    inner = model.model
    if stage.first:
        x = inner.embed_tokens(x)  # (B, T, C)
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
    rotary = inner.rotary_emb(x, positions)  # (cos, sin), each (1, T, head_dim)
    for layer in inner.layers.values():
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        x = out[0] if isinstance(out, tuple) else out
    return model.lm_head(inner.norm(x)) if stage.last else x


def _gpt_buffers(model: nn.Module) -> None:
    cfg, device = model.config, model.rope_cos.device
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)


def _llama_buffers(model: nn.Module) -> None:
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(rotary.inv_freq.device)


LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_GPT = Layout("gpt", ("tok_emb",), "blocks", ("norm", "lm_head"), _gpt_forward, _gpt_buffers)
_LLAMA = Layout(
    "llama", ("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"), _llama_forward, _llama_buffers
)


def layout_of(model: nn.Module) -> Layout:
    """The layout of ``model``'s family; ``ValueError`` for a model no stage knows how to run."""
    if isinstance(model, GPT):
        return _GPT
    if type(model).__name__ in LLAMA_FAMILY:
        return _LLAMA
    raise ValueError(
        f"--node-mode pipeline splits the built-in GPTs and {', '.join(LLAMA_FAMILY)}, not "
        f"{type(model).__name__}: use --node-mode fsdp"
    )


def stage_blocks(blocks: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous, as even as can be, the earlier stages one fewer where they
    differ (they hold the embedding). Pure."""
    if stages < 1 or blocks < stages:
        raise ValueError(f"a pipeline of {stages} stages needs at least {stages} blocks, the model has {blocks}")
    base, extra = divmod(blocks, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _tied(model: nn.Module, layout: Layout) -> bool:
    """Does the whole (unpruned) model's output head share its weight with its input embedding?"""
    head = model.get_submodule(layout.head[-1])
    embed = model.get_submodule(layout.embed[0])
    return getattr(head, "weight", None) is getattr(embed, "weight", 0)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``count``: which blocks, and whether the model ties its head to its embedding."""

    index: int
    count: int
    layout: Layout
    blocks: range
    tied: bool

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def holds_tied(self) -> bool:
        """Holds a copy of a tied embedding that another stage holds too."""
        return self.tied and self.count > 1 and (self.first or self.last)

    @property
    def tied_name(self) -> str:
        return f"{self.layout.embed[0]}.weight"


def plan_stage(model: nn.Module, index: int, count: int) -> Stage:
    """Stage ``index`` of ``count`` of the whole ``model`` (``ValueError`` if it cannot be split so)."""
    layout = layout_of(model)
    blocks = stage_blocks(len(model.get_submodule(layout.blocks)), count)[index]
    return Stage(index, count, layout, blocks, _tied(model, layout))


def stage_model(model: nn.Module, stage: Stage) -> nn.Module:
    """``model`` (whole, built on the meta device) pruned, in place, to ``stage``: its blocks (a
    ``ModuleDict`` keyed by their indices, so names stay the whole model's), the embedding on the first
    stage, the head on the last; a tied embedding also stays on the last stage (its head's weight)."""
    layout = stage.layout
    blocks = model.get_submodule(layout.blocks)
    keep = {*(layout.embed if stage.first or (stage.last and stage.tied) else ()), *(layout.head if stage.last else ())}
    for path in (*layout.embed, *layout.head):
        if path not in keep:
            _replace(model, path, None)
    _replace(model, layout.blocks, nn.ModuleDict({str(i): blocks[i] for i in stage.blocks}))
    return model


def _replace(model: nn.Module, path: str, module: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def materialize(model: nn.Module, stage: Stage, device: torch.device) -> nn.Module:
    """A pruned meta model allocated on ``device`` (parameters undefined: a state push or a copy fills
    them; buffers derived from the config computed); parameters shared between modules (a tied head) stay
    one tensor."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)  # allocates each holder's parameter apart
    for (module, name), *others in holders.values():
        for other, other_name in others:
            setattr(other, other_name, getattr(module, name))
    stage.layout.derive_buffers(model)
    return model


class StageModule(nn.Module):
    """One stage as the schedule runs it: the pruned model and the layout's forward."""

    def __init__(self, model: nn.Module, stage: Stage) -> None:
        super().__init__()
        self.model = model
        self.layout = stage.layout
        self.first, self.last = stage.first, stage.last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.forward(self, x)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``models.lm_loss``'s cross-entropy, of one micro-batch's logits (float32 for the softmax)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------- running


class PipelineRunner:
    """Runs a stage model's forward and backward over the node's pipeline, one batch at a time."""

    def __init__(
        self,
        model: nn.Module,
        stage: Stage,
        microbatches: int,
        schedule: str,
        tied_group: dist.ProcessGroup | None,
    ) -> None:
        self.model = model
        self.module = StageModule(model, stage)
        self.stage, self.microbatches = stage, microbatches
        device = next(model.parameters()).device
        pipe_stage = PipelineStage(self.module, stage.index, stage.count, device)
        self.schedule = SCHEDULES[schedule](pipe_stage, microbatches, loss_fn=_lm_loss)
        self._tied = model.get_parameter(stage.tied_name) if stage.holds_tied else None
        self._tied_group = tied_group

    def loss_and_backward(self, tokens: torch.Tensor, precision: str = "fp32") -> float:
        """The mean loss of ``tokens`` (rows, T + 1) over the node, every parameter of the stage with its
        gradient of it in ``.grad``; every rank passes the same tokens."""
        rows = tokens.shape[0]
        if rows % self.microbatches:
            raise ValueError(f"{rows} rows do not split into {self.microbatches} pipeline micro-batches")
        for p in self.model.parameters():
            p.grad = None
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        losses: list[torch.Tensor] = []
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            if self.stage.first:
                self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
            elif self.stage.last:
                self.schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._tied is not None:  # the embedding's gradient and the head's are one tensor's
            dist.all_reduce(self._tied.grad, group=self._tied_group)
        mine = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros(())
        total = mine.double().cpu().reshape(1)
        dist.all_reduce(total)  # only the last stage has the loss
        return float(total.item())


@functools.cache
def tied_group(stages: int) -> dist.ProcessGroup | None:
    """The group of the first and the last stage (a tied embedding's two holders); every rank calls this
    alike. Made once per process: every run's sessions share it."""
    if stages <= 2:
        return None  # the whole node
    return dist.new_group([0, stages - 1])


@torch.no_grad()
def clip_grad_norm_(params: Mapping[str, torch.Tensor], owned: Iterable[str], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model's gradients, split across the stages: the
    global norm (each tensor counted on the rank that owns it), then every stage's gradients scaled alike.
    A collective."""
    grads = [params[n].grad for n in owned]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    total = local.double().cpu().square().reshape(1)
    dist.all_reduce(total)
    norm = math.sqrt(float(total.item()))
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in params.values()], max_norm, torch.tensor(norm, device=grads[0].device if grads else "cpu")
        )
    return norm


# ------------------------------------------------------------------------------------------- replica


class StageReplica(Replica):
    """A replica of one stage: the stage's tensors and their outer momentum, with the whole model's codec
    and fingerprint. An update is decoded whole (every rank alike) and each stage steps its own tensors; a
    tied tensor is stepped on both of its stages, which keeps them equal. Every rank must make the same
    calls in the same order: ``fingerprint`` is a collective."""

    def __init__(
        self, model: nn.Module, rule: UpdateRule, shapes: Mapping[str, Sequence[int]], owned: Sequence[str]
    ) -> None:
        super().__init__(model, rule)
        self.shapes = {n: tuple(s) for n, s in shapes.items()}  # the whole model's, in its order
        self.owned = tuple(n for n in self.shapes if n in set(owned))  # what this stage encodes and counts
        self.numels = [math.prod(s) for s in self.shapes.values()]
        self._positions = sample_positions(list(self.shapes.items()))
        self.device = next(model.parameters()).device

    def codec(self, config: CodecConfig, fragment: Fragment | None = None) -> GradientCodec:
        """The whole model's codec (payloads and replays are the whole model's), on this stage's device; with
        ``fragment``, that fragment's."""
        if fragment is not None:
            return super().codec(config, fragment)
        if config not in self._codecs:
            self._codecs[config] = GradientCodec(
                self.shapes, config, device=self.device, transform_dtype=self.transform_dtype
            )
        return self._codecs[config]

    def fingerprint(self, with_moments: bool | None = None) -> Fingerprint:
        """The whole model's fingerprint (as ``replica.fingerprint`` of every tensor), a collective: every stage
        asks for the same (an order's, or the version's: ``takes_moments``)."""
        if with_moments is None:
            with_moments = takes_moments(self.version, self.moments_every)
        return self.fingerprint_of(self.params, with_moments)

    @torch.no_grad()
    def fingerprint_of(self, tensors: Mapping[str, torch.Tensor], with_moments: bool = True) -> Fingerprint:
        """The fingerprint of the whole model's tensors of this kind (``tensors``: this stage's, by name), a
        collective: each tensor's sums (unless ``with_moments`` is false) and samples from the stage that owns
        it, zeros elsewhere, summed over the node."""
        n = len(self.shapes)
        stats = torch.zeros(2 * n + sum(len(p) for p in self._positions), dtype=torch.float64)
        offset = 2 * n
        for i, (name, positions) in enumerate(zip(self.shapes, self._positions)):
            if name in self.owned:
                flat = tensors[name].detach().reshape(-1)
                if with_moments:
                    total, squares = moments(flat)
                    stats[i], stats[n + i] = total.cpu(), squares.cpu()
                stats[offset : offset + len(positions)] = flat[positions.to(flat.device)].float().double().cpu()
            offset += len(positions)
        dist.all_reduce(stats)  # one collective for the whole fingerprint
        found = Fingerprint.from_stats(stats, n)
        return found if with_moments else found.samples_only()


def owned_names(model: nn.Module, stage: Stage) -> list[str]:
    """The tensors ``stage``'s pruned ``model`` encodes: all of its own, but a tied embedding on the last
    stage, which is the first stage's."""
    names = [n for n, _ in model.named_parameters()]
    if stage.holds_tied and not stage.first:
        names.remove(stage.tied_name)
    return names
