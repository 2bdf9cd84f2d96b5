"""A character-level tokenizer for small models trained from scratch (the Sudoku quickstart).

Ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<end_of_turn>`` 3, ``<mask>`` 4 (the absorbing
process's mask token), then one id per character of the alphabet. Whitespace is skipped when
encoding, so ``"5 3 0"`` and ``"530"`` are the same three tokens: a grid of 81 digits is 81
tokens, not 161. There is no chat markup: a from-scratch model needs no instruction, so
:meth:`CharTokenizer.chat_prompt` returns the user text alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from dgemma.errors import DGemmaError

SPECIALS = ("<pad>", "<eos>", "<bos>", "<end_of_turn>", "<mask>")
ALPHABETS = {"digits": "0123456789", "lower": "abcdefghijklmnopqrstuvwxyz:"}


class CharTokenizer:
    pad_id, eos_id, bos_id, end_of_turn_id, mask_id = range(len(SPECIALS))

    def __init__(self, alphabet: str, name: str = "chars"):
        if len(set(alphabet)) != len(alphabet) or any(ch.isspace() for ch in alphabet):
            raise DGemmaError("a character alphabet must have distinct, non-space characters")
        self.name = name
        self.alphabet = alphabet
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(alphabet)}

    @classmethod
    def named(cls, name: str) -> "CharTokenizer":
        if name not in ALPHABETS:
            raise DGemmaError(f"unknown character tokenizer {name!r}; choose one of {sorted(ALPHABETS)}")
        return cls(ALPHABETS[name], name)

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for n, ch in enumerate(text):
            if ch.isspace():
                continue
            if ch not in self._ids:
                raise DGemmaError(f"character {ch!r} at offset {n} is not in the {self.name!r} tokenizer "
                                  f"(alphabet {self.alphabet!r})")
            ids.append(self._ids[ch])
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < len(SPECIALS):
                if not skip_special:
                    out.append(SPECIALS[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(SPECIALS)])
        return "".join(out)

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        return user_text

    def __repr__(self) -> str:
        return f"CharTokenizer({self.name!r}, vocab_size={self.vocab_size})"
