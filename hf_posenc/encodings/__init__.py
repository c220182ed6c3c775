"""Every encoding module; importing this package registers them all."""

from .absolute import Learned, NoPE, Sinusoidal
from .alibi import Alibi
from .base import ModelInfo, PosContext, PositionEncoding
from .cape import Cape
from .comrope import ComRope
from .compose import ComposedEncoding
from .cope import Cope
from .dpb import Dpb
from .fire import Fire
from .fope import Fope
from .fox import Fox
from .fox_pro import FoxPro
from .kerple import Kerple
from .liere import Liere
from .rope import Rope
from .rope2d import Rope2d
from .sandwich import Sandwich
from .sba import StickBreaking
from .shaw import Shaw
from .t5 import T5Bias
from .tape import Tape
from .xpos import Xpos

__all__ = ["Alibi", "Cape", "ComRope", "ComposedEncoding", "Cope", "Dpb", "Fire", "Fope", "Fox", "FoxPro", "Kerple", "Learned", "Liere", "ModelInfo", "NoPE", "PosContext", "PositionEncoding", "Rope", "Rope2d", "Sandwich", "Shaw", "Sinusoidal", "StickBreaking", "T5Bias", "Tape", "Xpos"]
