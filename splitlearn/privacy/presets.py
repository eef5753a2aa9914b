"""``recommended(shape, cut)``: the documented default defense, chosen from the measured frontier
of docs/PRIVACY.md ('A default, and how it was chosen'); ``--defense recommended`` on the meter's
command line.

A preset names a defense by its command-line form (:func:`~splitlearn.defense.defenses.parse_defense`), with the
clips left to the model (the median per-token norm at the cut on public text, as the meter
chooses it; for the U-shape's gradient defense, the median per-token norm of the gradient sent
back at the second cut), and the defense-aware fine-tuning it was measured with."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..errors import ConfigError
from ..defense.defenses import Defense, parse_defense

SHAPES = ("u", "2-way")


@dataclass(frozen=True)
class Preset:
    """A recommended defense: ``spec`` (``NAME:FIELD=V,...``, no clip nor grad_clip), the
    fine-tuning steps it was measured after, and what it measured (docs/PRIVACY.md)."""

    shape: str
    cut: tuple[int, ...]
    spec: str
    train_steps: int
    measured: str  # the row it comes from, in words

    def defense(self, clip: Optional[float] = None, grad_clip: Optional[float] = None) -> Defense:
        """The :class:`~splitlearn.defense.defenses.Defense`; ``clip``: the per-token clip in activation units (the
        median per-token norm at the cut: :func:`splitlearn.privacy.meter.median_token_norm`);
        needed by noise presets. ``grad_clip``: the per-token clip of the gradient sent back at the
        second cut (the median per-token gradient norm there:
        :func:`splitlearn.privacy.meter.median_token_grad_norm`); needed by presets that noise the
        gradient (``grad_sigma``) without fixing it. A field the spec gives wins over both."""
        given = {item.partition("=")[0].strip() for item in self.spec.partition(":")[2].split(",")}
        follows = "grad_sigma" in given and "grad_clip" not in given  # the gradient clip is the model's
        if follows and grad_clip is None:
            raise ConfigError(f"the recommended defense {self.spec!r} needs grad_clip= (the median "
                              f"per-token gradient norm at the second cut)")
        d = parse_defense(self.spec, clip=clip, grad_clip=grad_clip if follows else None)
        if hasattr(d, "clip") and "clip" not in given and clip is None:  # (grad_clip is not clip)
            raise ConfigError(f"the recommended defense {self.spec!r} needs clip= (the median per-token "
                              f"norm at the cut)")
        return d


#: measured presets (see docs/PRIVACY.md): per shape, the first cut they were measured at
_PRESETS = {
    # the U-shape residual design: the server computes on noised activations, the client keeps its
    # clean residual stream; sigma 4 at the median clip; the gradient the client sends back at the
    # second cut clipped per token to its median norm on public text (loss summed over the
    # tokens; like the activations' clip, it follows the model) and noised with sigma_g 2;
    # fine-tuned 200 steps with both
    "u": Preset("u", (1, 5), "gaussian:sigma=4,residual=1,grad_sigma=2", 200,
                "tiny-demo trained, 200 steps of defense-aware fine-tuning, the gradient clip the "
                "median per-token gradient norm at the second cut (0.44): best attack on the "
                "activations 0.184 at U-shape 1,5 and 3,5, on the gradient sent at the second cut "
                "(training) 0.173 and 0.167, perplexity 9.21 and 9.66 (1.04x and 1.09x the "
                "undefended 8.89); GPT-2 small's shape (random init trained 100 steps, U-shape 2,10, "
                "50 steps, gradient clip 0.0044): best attack 0.180, perplexity 15.79 (0.97x the "
                "undefended 16.23); epsilon per window (delta 1e-5) 16.5 for the activations, 41.6 "
                "for the gradients, 48.8 both"),
    # 2-way cannot keep the residual stream (the server holds the top); the labels (the text)
    # reach the server in training anyway: this protects the activations (e.g. a prompt) only
    "2-way": Preset("2-way", (1,), "gaussian:sigma=4", 200,
                    "tiny-demo trained, cut 1, 200 steps of defense-aware fine-tuning: best attack "
                    "0.186, perplexity 18.08 (2.03x the undefended 8.89: misses the 1.5x target); "
                    "the labels reach the server in training"),
}


def recommended(shape: str = "u", cut: Union[int, Sequence[int], None] = None) -> Preset:
    """The recommended defense for a split ``shape`` (``"u"``: U-shape, ``"2-way"``) at ``cut``
    (``c``, ``(c,)`` or ``(c1, c2)``; it must match the shape). The same preset serves every cut of
    a shape: its clips follow the cut and the model (:meth:`Preset.defense`). Raises
    :class:`ConfigError` on an unknown shape or a cut of the other shape."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown split shape {shape!r}; use one of {', '.join(SHAPES)}")
    p = _PRESETS[shape]
    if cut is not None:
        cuts = (cut,) if isinstance(cut, int) else tuple(cut)
        if len(cuts) != (2 if shape == "u" else 1):
            raise ConfigError(f"a {shape} split has {2 if shape == 'u' else 1} cut(s), got {cuts}")
        p = Preset(shape, cuts, p.spec, p.train_steps, p.measured)
    return p
