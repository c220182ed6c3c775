"""Written by hf_posenc beside every checkpoint it saves (named in the checkpoint's ``auto_map``).

``AutoModel*.from_pretrained(path, trust_remote_code=True)`` runs this file: it takes the classes of the
installed hf_posenc, which load the checkpoint patched with its position encoding. Without hf_posenc
installed it raises ImportError: ``pip install hf_posenc``.
"""

try:
    import hf_posenc  # noqa: F401  (registers hf_posenc's model types with transformers)
except ImportError as e:
    raise ImportError(
        "This checkpoint was saved from a model patched by hf_posenc (its position encoding is not the "
        "family's own): loading it needs hf_posenc. Install it with `pip install hf_posenc`."
    ) from e

from hf_posenc.auto import all_classes as _all_classes

globals().update(_all_classes())
