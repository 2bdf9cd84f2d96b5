"""The tokenizer: a thin wrapper over a Hugging Face fast tokenizer (``tokenizer.json``).

Built on the ``tokenizers`` library directly rather than on ``transformers`` so that loading a
checkpoint stays fast (importing ``transformers`` alone costs seconds). Folders it writes
(``tokenizer.json`` + ``tokenizer_config.json``) load in ``transformers.AutoTokenizer`` as well.

Gemma's chat format is produced here, not by a Jinja template: the Gemma 3 270M GGUF ships no
chat template. :meth:`Tokenizer.render_chat` reproduces Google's official Gemma 3 template for
text turns (system text folded into the first user turn, roles alternating, content trimmed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from dgemma.errors import DGemmaError

START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_name(value) -> str | None:
    """``tokenizer_config.json`` stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids, special-token ids and Gemma's chat format.

    ``config`` is the ``tokenizer_config.json`` content (special-token names, tokenizer class),
    kept so that a saved folder loads in ``transformers`` exactly as the source did.
    """

    def __init__(self, backend, config: dict | None = None):
        from tokenizers import Tokenizer as _Backend

        if not isinstance(backend, _Backend):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(backend).__name__}")
        self.backend = backend
        self.config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", **(config or {})}
        self.config.pop("added_tokens_decoder", None)  # tokenizer.json is the source of truth

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` if present) from ``folder``."""
        from tokenizers import Tokenizer as _Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DGemmaError(f"no tokenizer.json in {folder}")
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise DGemmaError(f"cannot read {path}: {e}") from None
        config = {}
        if (cfg_path := folder / "tokenizer_config.json").is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise DGemmaError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls(backend, config)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """A ``tokenizer.json`` (with the ``tokenizer_config.json`` beside it, if any) or its folder."""
        path = Path(path)
        if path.is_dir():
            return cls.from_dir(path)
        if path.name != "tokenizer.json":
            raise DGemmaError(f"expected a tokenizer.json or a folder holding one, got {path}")
        return cls.from_dir(path.parent)

    @classmethod
    def from_hf(cls, hf_tokenizer) -> "Tokenizer":
        """Wrap a ``transformers`` fast tokenizer (shares its Rust backend)."""
        config = {k: getattr(hf_tokenizer, k, None) for k in _SPECIAL_KEYS}
        config = {k: str(v) for k, v in config.items() if v is not None}
        config["tokenizer_class"] = type(hf_tokenizer).__name__
        return cls(hf_tokenizer.backend_tokenizer, config)

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by ``AutoTokenizer``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        config = {k: v for k, v in config.items() if v is not None}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    # -- ids ------------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special(self, key: str) -> int | None:
        name = _token_name(self.config.get(key))
        return None if name is None else self.backend.token_to_id(name)

    @property
    def bos_id(self) -> int | None:
        return self._special("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special("pad_token")

    @property
    def end_of_turn_id(self) -> int | None:
        """Gemma's ``<end_of_turn>``: where an instruction-tuned model stops (None if absent)."""
        return self.backend.token_to_id(END_OF_TURN)

    @property
    def vocab_size(self) -> int:
        """Token ids in use, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # -- text -----------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<end_of_turn>``) are parsed.

        The tokenizer's own post-processor (which adds ``<bos>``) is bypassed, so ``add_bos`` alone
        decides: a prompt is encoded with it, a continuation or a target without.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """:meth:`encode` over many texts, in parallel in the Rust backend."""
        out = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self._with_bos(ids) for ids in out] if add_bos else out

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_id is None:
            raise DGemmaError("this tokenizer has no bos token; encode with add_bos=False")
        return [self.bos_id, *ids]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids`` (a list, or a 1-D tensor/array)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    # -- chat -----------------------------------------------------------------------------------
    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """One user turn and the opening of the model's turn (no ``<bos>``: see :meth:`encode`)."""
        messages = [{"role": "user", "content": user_text}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return self.render_chat(messages, add_generation_prompt=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Gemma's turn format for ``[{"role", "content"}, ...]``, as Google's Gemma 3 template.

        Gemma has no system role: a leading system message is prepended to the first user turn,
        separated by a blank line. Roles must then alternate user/assistant (``assistant`` and
        ``model`` are synonyms); content is stripped of surrounding whitespace, as in the official
        template. The ``<bos>`` the template starts with is left to ``encode(add_bos=True)``.
        """
        messages = list(messages)
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise DGemmaError(f"a chat message must be {{'role': str, 'content': str}}, got {m!r}")
        prefix = ""
        if messages and messages[0]["role"] == "system":
            prefix = messages[0]["content"] + "\n\n"
            messages = messages[1:]
            if not messages:
                raise DGemmaError("a system message must be followed by a user message (Gemma folds it into that turn)")
        parts = []
        for i, m in enumerate(messages):
            role = {"assistant": "model"}.get(m["role"], m["role"])
            expected = "user" if i % 2 == 0 else "model"
            if role != expected:
                raise DGemmaError(
                    f"chat message {i} has role {m['role']!r}; roles must alternate user/assistant "
                    "(one optional system message first)"
                )
            parts.append(f"{START_OF_TURN}{role}\n{prefix if i == 0 else ''}{m['content'].strip()}{END_OF_TURN}\n")
        if add_generation_prompt:
            parts.append(f"{START_OF_TURN}model\n")
        return "".join(parts)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"


def load_tokenizer(source: str | Path) -> Tokenizer:
    """A tokenizer from a folder holding ``tokenizer.json`` or the file itself. Names of
    pretrained models (``"gemma3-270m"``) are resolved to their folders one layer up
    (``dgemma/models/pretrained.py:resolve``): this module imports nothing from ``dgemma.models``."""
    path = Path(source).expanduser()
    if not path.exists():
        raise DGemmaError(f"no tokenizer at {path}: give a folder with tokenizer.json or the file "
                          f"(for 'gemma3-270m', pass dgemma.models.pretrained.resolve('gemma3-270m'))")
    return Tokenizer.from_file(path)
