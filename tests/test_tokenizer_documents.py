"""Plain-text documents are marked as the tokenizer's own encoding marks a text, as transformers
encodes one (`tok(text)`): a Llama-style tokenizer (add_bos_token, or a post-processor template
"<s> $A") puts its BOS at each document's start, a GPT-2-style one adds nothing; the eot between
documents stays the stream's one separator (never doubled). Tokenizers built offline: a WordLevel
vocabulary (tokenizers) wrapped and saved by transformers, loaded back by our tokenizer=hf.
"""

from __future__ import annotations

import numpy as np
import pytest

from loaders import tokenizers
from loaders.tokens import cached_windows, tokenize_documents
from loaders.windows import WindowDataset

WORDS = ["hello", "world", "fine", "tune", "me"]
VOCAB = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", tokenizers.EOT_TOKEN, *WORDS])}
UNK, BOS, EOS, EOT = 0, 1, 2, 3
DOCS = ["hello world", "fine tune me", "", "world"]
PLAIN = [[4, 5], [6, 7, 8], [], [5]]  # each document's words, no marks


def build(path, kind: str):
    """A tokenizer directory of `kind`, loaded as the run loads tokenizer=hf."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    llama = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if kind == "gpt2":  # GPT-2's convention: <|endoftext|> is bos and eos, and encoding adds nothing
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tokenizers.EOT_TOKEN,
                                      eos_token=tokenizers.EOT_TOKEN, unk_token="<unk>")
    elif kind == "add_bos_token":  # Llama's tokenizer_config: add_bos_token true, add_eos_token false
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=True, **llama)
    elif kind == "template":  # Llama 3's tokenizer.json: a TemplateProcessing post-processor
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                               special_tokens=[("<s>", BOS)])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **llama)
    elif kind == "bos_and_eos":  # add_eos_token true as well (OLMo): its eos is the eot we append anyway
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=True, add_eos_token=True, **llama)
    elif kind == "bos_is_eot":  # a BOS that is the eot: the eot before each document is already its start
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=True, bos_token=tokenizers.EOT_TOKEN,
                                      eos_token=tokenizers.EOT_TOKEN, unk_token="<unk>")
    tok.save_pretrained(path)
    return tokenizers.hf_tokenizer(str(path))


# kind -> (its eot, what transformers' own encoding puts around a text, each document's ids in our stream)
KINDS = {
    "gpt2": (EOT, ([], []), lambda ids: ids),
    "add_bos_token": (EOS, ([BOS], []), lambda ids: [BOS, *ids]),
    "template": (EOS, ([BOS], []), lambda ids: [BOS, *ids]),
    "bos_and_eos": (EOS, ([BOS], [EOS]), lambda ids: [BOS, *ids]),
    "bos_is_eot": (EOT, ([EOT], []), lambda ids: ids),
}


@pytest.mark.parametrize("kind", KINDS)
def test_documents_are_marked_as_the_tokenizer_marks_a_text(tmp_path, kind):
    tok = build(tmp_path, kind)
    eot, (before, after), ours = KINDS[kind]
    assert tok.eot_id == eot
    for doc, ids in zip(DOCS, PLAIN):  # the premise: transformers' encoding of a text, with and without its marks
        assert tok._tok(doc, add_special_tokens=False)["input_ids"] == ids
        assert tok._tok(doc)["input_ids"] == [*before, *ids, *after]
    stream = tokenize_documents(DOCS, tok)
    assert stream.tolist() == [t for ids in PLAIN for t in (*ours(ids), eot)]
    # pieces of text (chat turns, loaders/chat.py) are never marked: a template writes its own BOS
    assert [x.tolist() for x in tok.encode_batch(DOCS)] == PLAIN


@pytest.mark.parametrize("kind", ["add_bos_token", "template"])
def test_document_masks_keep_the_bos_with_its_document(tmp_path, kind):
    """Packed documents: a segment starts after each eot, at the next document's BOS, so the BOS
    attends with its document, and (as for every document start) no loss predicts it across the eot."""
    tok = build(tmp_path, kind)
    stream = tokenize_documents(DOCS * 4, tok)  # BOS 4 5 EOS BOS 6 7 8 EOS BOS EOS BOS 5 EOS ...
    ds = WindowDataset(stream, window=len(stream) // 2, eot_id=tok.eot_id, document_mask=True)
    row = ds.get(np.array([0]))
    tokens, seg, loss = row["tokens"][0], row["segment_ids"][0], row["loss_mask"][0]
    assert (tokens[1:-2] == BOS).sum() >= 3  # several document starts inside the row
    for t in np.flatnonzero(tokens[:-2] == BOS):
        assert t == 0 or tokens[t - 1] == EOS  # every BOS follows an eot (or starts the stream)
        assert seg[t] == seg[t + 1]  # the BOS is in its document's segment
        if t > 0:
            assert seg[t] == seg[t - 1] + 1 and loss[t - 1] == 0  # a new document; its BOS is not a target


def test_a_gpt2_style_tokenizer_keeps_its_token_caches(tmp_path):
    """Its fingerprint is what it was (token caches and memmap datasets stay valid); a marked
    tokenizer's is new, so a stream cached before documents were marked is not reused."""
    from loaders.tokenizers.hf import _hf_fingerprint

    none = np.zeros(0, np.int32)
    gpt2 = build(tmp_path / "gpt2", "gpt2")
    assert gpt2.fingerprint == _hf_fingerprint(gpt2._tok, none, none)
    llama = build(tmp_path / "llama", "add_bos_token")
    assert llama.fingerprint != _hf_fingerprint(llama._tok, none, none)
    assert llama.fingerprint == tokenizers.hf_tokenizer(str(tmp_path / "llama")).fingerprint  # stable


def test_the_run_windows_start_documents_with_the_bos(tmp_path):
    """The training stream (cached_windows, what loaders/pipeline.py builds), through its cache."""
    tok = build(tmp_path / "tok", "add_bos_token")
    for _ in range(2):  # computed, then read back from the cache
        ds = cached_windows(DOCS * 8, tok, str(tmp_path / "cache"), "text", "train", window=9)
        assert np.asarray(ds.tokens[:4]).tolist() == [BOS, 4, 5, EOS]
        assert int((np.asarray(ds.tokens) == BOS).sum()) == len(DOCS) * 8


def test_byte_and_bpe_documents_are_unmarked():
    """The default tokenizers: a document is its text's ids, then the eot, as before."""
    byte = tokenizers.byte_tokenizer()
    assert tokenize_documents(["ab", "", "c"], byte).tolist() == [97, 98, 256, 256, 99, 256]
    from loaders.tokenizers.bpe import _train_bpe

    bpe = tokenizers.BPETokenizer(_train_bpe(260, ["hello world, fine tune me\n"] * 4), "bpe-260")
    docs = ["hello world", "tune me"]
    assert [x.tolist() for x in bpe.encode_documents(docs)] == [x.tolist() for x in bpe.encode_batch(docs)]
    want = [t for ids in bpe.encode_batch(docs) for t in (*ids.tolist(), bpe.eot_id)]
    assert tokenize_documents(docs, bpe).tolist() == want


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_prompt_starts_as_a_training_document_does(tmp_path, kind):
    """Sampling (train.sample_tokens, scripts/sample.py) prompts the model with the ids a document
    of that text had in training: a Llama tokenizer's BOS first; an empty prompt after an eot."""
    from models.sample import sample_text

    tok = build(tmp_path, kind)
    eot, _, ours = KINDS[kind]
    prompts = []

    def generate(model, prompt_ids, num_tokens, key, temperature, stop_id, context_length):
        prompts.append([int(i) for i in prompt_ids])
        return list(prompt_ids)

    for text in ("hello world", ""):
        sample_text(None, tok, text, 4, None, 1.0, generate_fn=generate)
    assert prompts == [ours(PLAIN[0]), [eot, *ours([])]]
