"""trainstream: train PyTorch models whose optimizer state lives in host RAM, updated by trainstreamd.

    import trainstream
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4))

`wrap` connects to the node's daemon (or starts a private one), moves the optimizer state into it, and
returns the model (same object, with hooks) and an optimizer that behaves like the torch one.
"""

import torch  # noqa: F401  (loaded before _C: its libraries first, as in every torch program; see _C below)

from trainstream import _amp, _clipping, _compile, _wrap
from trainstream._C import TrainstreamError, __version__
from trainstream._connect import Client, connect
from trainstream._losses import chunked_cross_entropy
from trainstream._wrap import synchronize, unwrap, wrap
from trainstream.activations.paging import activation_paging

_clipping.install()  # clip_grad_norm_ of wrapped parameters clips in the daemon
_amp.install()  # a GradScaler's check of a wrapped optimizer's gradients is the daemon's
_compile.install(_wrap.current_rank)  # a compiled forward of a wrapped model takes its weights in before Dynamo runs
_wrap.install()  # Module.zero_grad of a wrapped model drops the step's gradients in the daemon too

__all__ = ["Client", "TrainstreamError", "activation_paging", "chunked_cross_entropy", "connect", "synchronize",
           "unwrap", "wrap", "__version__"]
