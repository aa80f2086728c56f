"""A ``tokenizer.json`` (Hugging Face ``tokenizers`` format) from a SentencePiece-BPE vocabulary as a GGUF stores it.

A GGUF of a Gemma model carries the pieces, their scores and their types but no merges; the serving side reads
``tokenizer.json`` with the ``tokenizers`` library, so the converter rebuilds one (transformers is not needed):

* model: BPE over the pieces with their GGUF ids, byte fallback (the ``<0x00>``…``<0xFF>`` pieces), ``<unk>``.
* merges: every split of a piece into two pieces that both exist is a merge producing it. SentencePiece BPE merges
  the adjacent pair whose result ranks best; for Gemma the rank is the piece's position in the vocabulary (the
  scores of normal pieces are minus their id, and the special ones carry placeholder scores), so merges are
  ordered by the id of the piece they make; the splits of one piece by longer left part first.
* pieces made only of spaces are stored by llama.cpp with real spaces; SentencePiece spells them with ``▁``
  (U+2581), which is what the text becomes after the normalizer, so they are respelled.
* normalizer: spaces become ``▁`` (plus a leading ``▁`` when the vocabulary asks for a space prefix);
  no pre-tokenizer: SentencePiece sees the whole text at once.
* control pieces (``<bos>``, ``<start_of_turn>``, ``<unusedN>``…) are special added tokens; user-defined pieces
  (``\\n\\n``, tab runs, ``<start_of_image>``…) are plain added tokens: SentencePiece matches both whole.
* decoder: ``▁`` back to a space, bytes fused back into UTF-8.
* post-processor: ``<bos>`` first (and ``<eos>`` last) when the vocabulary says the model adds them.

tests/test_gemma3.py checks the result against transformers' own GGUF tokenizer on ASCII, accents, CJK, emoji,
space runs and newlines.
"""
from __future__ import annotations

from collections import Counter

from .errors import ConversionError
from .gguf_source import GgufTokenizer

SPACE_MARK = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def _respell(piece: str) -> str:
    return SPACE_MARK * len(piece) if piece and not piece.strip(" ") else piece


def bpe_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """The merges of a SentencePiece-BPE vocabulary ordered by the id of the piece they make."""
    ids = {}
    for i, p in enumerate(pieces):
        ids.setdefault(p, i)
    merges = []
    for piece in pieces:
        # longer left part first among the splits of one piece
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((left, right))
    return merges


def build_tokenizer(vocab: GgufTokenizer):
    """A ``tokenizers.Tokenizer`` for a SentencePiece ("llama") GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    if vocab.model != "llama":
        raise ConversionError(f"tokenizer model {vocab.model!r} is not supported: only SentencePiece "
                              "vocabularies (tokenizer.ggml.model 'llama') can be rebuilt as tokenizer.json")
    pieces = [_respell(p) for p in vocab.tokens]
    if len(set(pieces)) != len(pieces):
        dups = [p for p, n in Counter(pieces).items() if n > 1]
        raise ConversionError(f"the vocabulary spells {len(dups)} pieces more than once (e.g. {dups[:3]!r}): "
                              "their ids could not all be produced")
    if vocab.unk_id is None:
        raise ConversionError("the vocabulary names no unknown token (tokenizer.ggml.unknown_token_id)")
    unk = pieces[vocab.unk_id]
    model = BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=bpe_merges(pieces), unk_token=unk,
                fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    steps = [normalizers.Replace(" ", SPACE_MARK)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE_MARK))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)

    # Pieces SentencePiece matches whole, before BPE: control ones are special, user-defined ones are text.
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(pieces, vocab.token_types) if t == _CONTROL])
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p, raw, t in zip(pieces, vocab.tokens, vocab.token_types) if t == _USER_DEFINED and p == raw])

    specials = []
    single = "$A:0"
    if vocab.add_bos:
        if vocab.bos_id is None:
            raise ConversionError("the vocabulary asks for a BOS token but names none (tokenizer.ggml.bos_token_id)")
        single = f"{pieces[vocab.bos_id]}:0 {single}"
        specials.append((pieces[vocab.bos_id], vocab.bos_id))
    if vocab.add_eos:
        if vocab.eos_id is None:
            raise ConversionError("the vocabulary asks for an EOS token but names none (tokenizer.ggml.eos_token_id)")
        single = f"{single} {pieces[vocab.eos_id]}:0"
        specials.append((pieces[vocab.eos_id], vocab.eos_id))
    if specials:
        pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok
