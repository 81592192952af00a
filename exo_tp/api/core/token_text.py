"""The bytes and text of single tokens, for per-token log-probabilities (OpenAI gives both: a
byte-level token may hold half of a character)."""

from __future__ import annotations

import functools

from mlx_lm.tokenizer_utils import TokenizerWrapper


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed: byte-level BPE vocabularies spell every byte
    as one printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenText:
    """Bytes and display text of token ids, cached per id."""

    def __init__(self, tokenizer: TokenizerWrapper):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        known = self._cache.get(token)
        if known is None:
            raw = self._bytes(token)
            known = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._cache) < 100_000:
                self._cache[token] = known
        return known

    def _bytes(self, token: int) -> bytes:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            alphabet = _byte_level_alphabet()
            if isinstance(piece, str) and piece and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return self._tokenizer.decode([token]).encode("utf-8")


def _is_byte_level(tokenizer: TokenizerWrapper) -> bool:
    try:
        decoder = tokenizer.backend_tokenizer.decoder
    except AttributeError:  # a slow or custom tokenizer
        return False
    return type(decoder).__name__ == "ByteLevel"
