"""Every encoding module; importing this package registers them all."""

from .absolute import Learned, NoPE, Sinusoidal
from .alibi import Alibi
from .base import ModelInfo, PosContext, PositionEncoding
from .cape import Cape
from .fire import Fire
from .kerple import Kerple
from .rope import Rope
from .sandwich import Sandwich
from .shaw import Shaw
from .t5 import T5Bias

__all__ = ["Alibi", "Cape", "Fire", "Kerple", "Learned", "ModelInfo", "NoPE", "PosContext", "PositionEncoding", "Rope", "Sandwich", "Shaw", "Sinusoidal", "T5Bias"]
