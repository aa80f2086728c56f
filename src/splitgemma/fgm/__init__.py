"""The FASTGEM1 (.fgm) weight file: converter from Hugging Face checkpoints, random-model writer,
quantisers and the streaming writer. Pure Python + numpy."""
from .convert import convert_checkpoint
from .errors import ConversionError
from .inventory import DEFAULT_GROUP, WEIGHT_MODES

__all__ = ["ConversionError", "DEFAULT_GROUP", "WEIGHT_MODES", "convert_checkpoint"]
