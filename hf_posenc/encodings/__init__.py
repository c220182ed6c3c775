"""Every encoding module; importing this package registers them all."""

from .absolute import Learned, NoPE, Sinusoidal
from .alibi import Alibi
from .base import ModelInfo, PosContext, PositionEncoding
from .rope import Rope

__all__ = ["Alibi", "Learned", "ModelInfo", "NoPE", "PosContext", "PositionEncoding", "Rope", "Sinusoidal"]
