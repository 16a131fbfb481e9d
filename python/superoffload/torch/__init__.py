"""superoffload for PyTorch: SuperOffloadAdamW, a torch.optim.Optimizer whose AdamW runs on the
CPU in libsuperoffload, stepping sub-groups speculatively during backward with exact clipping.

    from superoffload.torch import SuperOffloadAdamW
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0, model=model)
"""
from .._core import SuperOffloadError
from .optimizer import SuperOffloadAdamW

__all__ = ["SuperOffloadAdamW", "SuperOffloadError"]
