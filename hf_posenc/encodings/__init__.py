"""Every encoding module; importing this package registers them all."""

from .absolute import Learned, NoPE, Sinusoidal
from .alibi import Alibi
from .base import ModelInfo, PosContext, PositionEncoding
from .cape import Cape
from .comrope import ComRope
from .fire import Fire
from .fope import Fope
from .kerple import Kerple
from .liere import Liere
from .rope import Rope
from .rope2d import Rope2d
from .sandwich import Sandwich
from .shaw import Shaw
from .t5 import T5Bias

__all__ = ["Alibi", "Cape", "ComRope", "Fire", "Fope", "Kerple", "Learned", "Liere", "ModelInfo", "NoPE", "PosContext", "PositionEncoding", "Rope", "Rope2d", "Sandwich", "Shaw", "Sinusoidal", "T5Bias"]
