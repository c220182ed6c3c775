"""Every encoding module; importing this package registers them all."""

from .absolute import Learned, NoPE, Sinusoidal
from .alibi import Alibi
from .base import ModelInfo, PosContext, PositionEncoding
from .kerple import Kerple
from .rope import Rope
from .sandwich import Sandwich

__all__ = ["Alibi", "Kerple", "Learned", "ModelInfo", "NoPE", "PosContext", "PositionEncoding", "Rope", "Sandwich", "Sinusoidal"]
