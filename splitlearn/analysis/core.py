"""``analyze(config)``: what each segment of a split decoder-only model (any family the adapter,
:mod:`splitlearn.model.arch`, knows) costs, as one JSON-able dict.

Per segment and submodule: parameters, MACs/FLOPs, latency, peak memory, output bytes; per cut
the bytes crossing it; per operator the roofline class. Modes ``prefill``, ``decode``,
``train``; each segment runs on the activations the one before it produced. On the meta device
(``device="meta"``: shapes, no weights) only what shapes decide is reported: parameters,
MACs/FLOPs, output, KV and wire bytes; latency, memory peaks and operators are None. The
report's layout and how each figure is measured: docs/ANALYSIS.md."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from ..model.devices import dtype_name, resolve_device, resolve_dtype
from ..errors import ConfigError
from ..model.arch import arch_of
from ..model.loading import load_model
from ..model.partition import Partition, partition, validate_cuts
from ..model.segments import Segment, loss_from_logits
from . import memory, roofline, timing
from .counting import SegmentArgs, SegmentRunner, count_segment, named_submodules, runner
from .traffic import cut_traffic, kv_cache_bytes, tied_parameters

log = logging.getLogger(__name__)

MODES = ("prefill", "decode", "train")


@dataclass
class AnalysisConfig:
    """What to analyse and how; every field is also a command-line flag."""

    model: str = "tiny"                  # load_model source: spec name, hub id, dir, JSON
    cuts: tuple[int, ...] = (2,)         # one cut (2-way) or two (U-shape); () = none (sweep)
    batch_size: int = 1                  # sequences per batch
    seq_len: int = 6                     # tokens per sequence (the KV length in decode)
    device: str = "cpu"                  # cpu | cuda | auto | meta (shapes only: no weights, no timing)
    dtype: str = "float32"               # float32 | bfloat16 | float16 (compute dtype)
    mode: str = "prefill"                # prefill | decode | train
    repeats: int = 20                    # timed runs per segment
    warmup: int = 5                      # untimed runs before them
    max_seconds: float = 10.0            # timing budget per segment, s (>= 3 runs kept)
    peak_tflops: Optional[float] = None  # device peak, 10^12 FLOP/s (None: measure)
    mem_bw_gbs: Optional[float] = None   # device memory bandwidth, GB/s (None: measure)
    roofline: bool = True                # per-operator arithmetic intensity
    seed: int = 0                        # random weights and token ids

    def __post_init__(self):
        if isinstance(self.cuts, int):
            self.cuts = (self.cuts,)
        self.cuts = tuple(self.cuts)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("batch_size", "seq_len", "repeats"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_seconds <= 0:
            raise ConfigError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.mode == "train" and self.seq_len < 2:
            raise ConfigError("train mode needs seq_len >= 2 (the loss predicts the next token)")
        for name in ("peak_tflops", "mem_bw_gbs"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be > 0, got {v}")
        resolve_dtype(self.dtype)  # raises ConfigError on unknown names


def max_positions(cfg) -> tuple[str, Optional[int]]:
    """(field, limit) of the positions a model can take: a learned table's size (the adapter's
    ``Family.max_positions``), else ``max_position_embeddings`` (rotary: what it was trained for)."""
    field = arch_of(cfg).family.max_positions or "max_position_embeddings"
    return field, getattr(cfg, field, None)


def check_shapes(cfg, config: AnalysisConfig) -> None:
    """Refuse sequences the model cannot position (prefill T, decode T + 1 tokens)."""
    need = config.seq_len + (1 if config.mode == "decode" else 0)
    field, limit = max_positions(cfg)
    if limit and need > limit:
        raise ConfigError(f"sequence of {need} tokens ({config.mode}) is longer than the model's "
                          f"{field}={limit}")


def segment_inputs(part: Partition, config: AnalysisConfig, device: torch.device) -> list[tuple]:
    """The real arguments of each segment's :class:`~.counting.SegmentRunner` call, in order
    (decode: :class:`~.counting.SegmentArgs` with the KV tensors of a prefill of ``seq_len``)."""
    gen = torch.Generator().manual_seed(config.seed)
    shape = (config.batch_size, config.seq_len)
    ids = torch.randint(0, part.config.vocab_size, shape, generator=gen).to(device)  # (B, T)
    args = []
    with torch.no_grad():
        if config.mode != "decode":
            x = ids
            for seg in part.segments:
                args.append((x,))
                x = SegmentRunner(seg)(x)
            return args
        caches = part.new_caches()
        part(ids, caches=caches)  # prefill fills every segment's cache
        x = torch.randint(0, part.config.vocab_size, (config.batch_size, 1), generator=gen)
        x = x.to(device)  # (B, 1)
        for seg, cache in zip(part.segments, caches):
            kv = []
            for layer in range(seg.start, seg.end):
                slot = cache.kv.layers[layer]
                kv += [slot.keys, slot.values]  # (B, H_kv, T_l, head_dim) each; T_l <= T (a window)
            args.append(SegmentArgs((x, *kv), past=config.seq_len))
            x = seg(x, cache=cache)
    return args


def make_run(seg: Segment, args: tuple, mode: str, seed: int):
    """(prepare, run): ``run()`` does one step of ``mode``; ``prepare()`` zeroes gradients."""
    call = runner(seg, args)
    if mode != "train":
        def run():
            with torch.no_grad():
                call(*args)
        return (lambda: None), run
    x = args[0] if args[0].is_floating_point() else None
    if seg.has_head:
        labels = torch.randint(0, seg.config.vocab_size, args[0].shape[:2],
                               generator=torch.Generator().manual_seed(seed)).to(args[0].device)
    else:
        grad = torch.randn(*args[0].shape[:2], seg.config.hidden_size,
                           generator=torch.Generator().manual_seed(seed))
        grad = grad.to(args[0].device, next(seg.layers_list.parameters()).dtype if len(seg.layers_list)
                       else torch.float32)

    def prepare():
        seg.zero_grad(set_to_none=True)

    def run():
        with torch.enable_grad():
            inp = x.detach().requires_grad_() if x is not None else args[0]
            out = call(inp, *args[1:])
            if seg.has_head:
                loss_from_logits(out, labels).backward()
            else:
                out.backward(grad.to(out.dtype))
    return prepare, run


def output_shapes(seg: Segment, args: tuple, subs: dict) -> dict[str, tuple]:
    """Shape and element size of every submodule's output (one forward with hooks)."""
    shapes, handles = {}, []
    for name, (mod, _) in subs.items():
        def hook(_m, _i, out, n=name):
            t = out[0] if isinstance(out, tuple) else out
            shapes[n] = (tuple(t.shape), t.element_size())
        handles.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        out = runner(seg, args)(*args)
    for h in handles:
        h.remove()
    shapes[""] = (tuple(out.shape), out.element_size())
    return shapes


def _row(name: str, mod: nn.Module, macs: dict, lat: Optional[timing.Latency], peak: Optional[int],
         shape) -> dict:
    m = macs.get(name, 0)
    n_out = 1
    for s in shape[0]:
        n_out *= s
    return {"name": name, "params": sum(p.numel() for p in mod.parameters()),
            "macs": m, "flops": 2 * m, "latency_ms": None if lat is None else lat.to_dict(),
            "peak_memory_bytes": None if peak is None else memory.resident_bytes(mod) + peak,
            "output_shape": list(shape[0]), "output_bytes": n_out * shape[1]}


def keys_of(args: tuple) -> int:
    """Keys a new token attends to in a full layer: the new tokens + the past (decode)."""
    S = args[0].shape[1]
    return S + (getattr(args, "past", 0) or (max(int(k.shape[2]) for k in args[1::2]) if len(args) > 1 else 0))


def time_segment(seg: Segment, run, prepare, mods: dict, subs: dict, device: torch.device,
                 config: AnalysisConfig) -> timing.Timing:
    """:func:`~.timing.time_runs` of ``seg`` with every row hooked. In train mode a family whose
    layer adds into a part's output in place (Falcon's parallel residual: ``mlp_output +=
    attention_output``) cannot carry a backward hook on that part (torch refuses an in-place
    change of a hooked output): then only the top-level rows (layers, embeddings, head) are
    timed, and the parts' latency is None."""
    kw = dict(backward=config.mode == "train", prepare=prepare, max_seconds=config.max_seconds)
    try:
        return timing.time_runs(run, mods, device, config.repeats, config.warmup, **kw)
    except RuntimeError as e:
        if config.mode != "train" or "BackwardHookFunction" not in str(e):
            raise
    log.warning("%s %s: a layer changes a part's output in place, which a backward hook forbids; "
                "timing the layers whole", seg.arch.model_type, seg.kind)
    prepare()
    top = {n: m for n, (m, p) in subs.items() if not p}
    return timing.time_runs(run, top, device, config.repeats, config.warmup, **kw)


def analyze_segment(seg: Segment, args: tuple, config: AnalysisConfig, device: torch.device,
                    peaks: Optional[roofline.DevicePeaks]) -> dict:
    """Every figure of one segment (see the module docstring); JSON-able."""
    subs = named_submodules(seg)
    mods = {n: m for n, (m, _) in subs.items()}
    S = args[0].shape[1]
    keys = keys_of(args)
    counts = count_segment(seg, args, config.batch_size, S, keys, train=config.mode == "train")
    shapes = output_shapes(seg, args, subs)
    meta = device.type == "meta"  # shapes only: nothing to time or measure
    t = peak_total = None
    peak_sub: dict = {}
    checks = []
    if not meta:
        prepare, run = make_run(seg, args, config.mode, config.seed)
        t = time_segment(seg, run, prepare, mods, subs, device, config)
        prepare()
        peak_total, peak_sub = memory.measure_peaks(run, mods, device)
        prepare()
        parents = {p for n, (_, p) in subs.items() if n in t.modules}  # "" and every layer whose parts were timed
        for parent in [""] + [n for n, (_, p) in subs.items() if p == "" and n in parents]:
            kids = {n: t.modules[n].median for n, (_, p) in subs.items() if p == parent}
            whole = t.total if parent == "" else t.modules[parent]
            spread = max([whole.spread] + [t.modules[n].spread for n in kids])  # a busy machine: noisy, not off
            checks.append(timing.sum_check(parent, whole.median, kids, spread).to_dict())
    row = _row("", seg, counts.fvcore, None if t is None else t.total, peak_total, shapes[""])
    row.pop("name")
    out = {"name": seg.kind, "blocks": [seg.start, seg.end], **row,
           "kv_cache_bytes": kv_cache_bytes(seg, config.batch_size, keys if config.mode == "decode"
                                            else S),
           "submodules": [dict(_row(n, m, counts.fvcore, None if t is None else t.modules.get(n),
                                    None if meta else peak_sub.get(n, 0), shapes.get(n, ((0,), 0))), parent=p)
                          for n, (m, p) in subs.items()],
           "latency_sum_checks": checks,
           "mac_crosscheck": {"flop_counter": counts.flop_counter.get(""),
                              "analytic": counts.analytic.get(""),
                              "mismatches": [asdict(m) for m in counts.mismatches]}}
    if peaks is not None and not meta:
        prepare()
        out["operators"] = [o.to_dict(peaks.ridge) for o in roofline.profile_ops(run)]
        prepare()
    return out


def prepare_model(config: AnalysisConfig, model: Optional[nn.Module] = None):
    """(model, partition, device) for ``config``; raises ConfigError on anything unusable."""
    from .shapes import check_shape_device, shape_config

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype)
    if model is None:
        check_shape_device(config.model, device.type)
    source = model if model is not None else (shape_config(config.model) or config.model)
    model = load_model(source, dtype=dtype, device=device, seed=config.seed)
    check_shapes(model.config, config)
    if not config.cuts:
        return model, None, device
    validate_cuts(config.cuts, arch_of(model.config).n_layers)
    return model, partition(model, config.cuts), device


def analyze(config: AnalysisConfig, model: Optional[nn.Module] = None) -> dict:
    """Analyse ``config.model`` cut at ``config.cuts`` (or ``model``, already loaded); returns the
    report of docs/ANALYSIS.md. Raises :class:`~splitlearn.errors.ConfigError` on unusable input."""
    model, part, device = prepare_model(config, model)
    if part is None:
        raise ConfigError("analyze needs at least one cut (config.cuts is empty)")
    return analyze_partition(model, part, device, config)


def analyze_partition(model: nn.Module, part: Partition, device: torch.device,
                      config: AnalysisConfig) -> dict:
    """:func:`analyze` for a model already loaded and partitioned."""
    peaks = (roofline.measure_peaks(device, model.dtype, config.peak_tflops, config.mem_bw_gbs)
             if config.roofline and device.type != "meta" else None)
    inputs = segment_inputs(part, config, device)
    segments = []
    for seg, args in zip(part.segments, inputs):
        log.info("analysing %s %s", seg.kind, seg.blocks)
        segments.append(analyze_segment(seg, args, config, device, peaks))
    return {
        "config": {**asdict(config), "cuts": list(config.cuts)},
        "model": model_info(model),
        "device": device_info(device),
        "roofline": None if peaks is None else {**asdict(peaks), "ridge_flops_per_byte": peaks.ridge},
        "segments": segments,
        "cuts": cut_traffic(part, config.batch_size, 1 if config.mode == "decode" else config.seq_len,
                            config.mode),
        "tied_parameters": tied_parameters(part),
    }


def model_info(model: nn.Module) -> dict:
    """The report's "model" entry: the family, its shape (transformers' generic names) and the
    unique parameter count."""
    cfg = model.config
    arch = arch_of(cfg)
    kv_heads, head_dim = arch.kv_heads_and_dim()
    return {"model_type": cfg.model_type, "num_hidden_layers": arch.n_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "vocab_size": cfg.vocab_size, "max_positions": max_positions(cfg)[1],
            "layer_types": sorted(set(arch.layer_types)),
            "params": sum(p.numel() for p in model.parameters()), "dtype": dtype_name(model.dtype)}


def device_info(device: torch.device) -> dict:
    import os
    import platform
    if device.type == "meta":
        return {"type": "meta", "name": "meta (shapes only: no weights, nothing timed)"}
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device)}
    return {"type": "cpu", "name": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
