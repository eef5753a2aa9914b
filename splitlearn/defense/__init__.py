"""What the client does to the activations before they cross the cut (docs/PRIVACY.md, 'Defenses'):
:mod:`.defenses` (Gaussian noise with clipping, NoPeek) and their differential-privacy accounting
(:mod:`.accounting`). The model classes (:mod:`splitlearn.hf`) apply them; the tools that measure
them (the leakage meter, the attacks) are :mod:`splitlearn.privacy`, a floor up."""
