"""A tiny random prompt enhancer in the release's layout (``pe/`` + ``pe_tokenizer/``), built from configs with
transformers and the ``tokenizers`` library (no downloads): a 2-layer Ministral3ForCausalLM, a byte-level BPE
tokenizer trained on a few sentences, and a chat template that ends the user block with "Output:" as the
release's does. ``write_tiny_pe(root)`` -> (pe folder, pe_tokenizer folder). ``endless=True``: the end-of-text
token's (tied) embedding row is zero, so its logit is 0 while the best other one is above it: with greedy
decoding (``generation={"do_sample": False}``) the PE writes until max_new_tokens, a slow request on demand."""
from __future__ import annotations

import json
import os

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM]{{ m['content'] }}[/SYSTEM]"
    "{% elif m['role'] == 'user' %}[INST]{{ m['content'] }}\nOutput:{% endif %}{% endfor %}"
)
CORPUS = [
    'a black-and-white Chinese rural dog running on grass, {"prompt": "", "width": 1024, "height": 1024}',
    "night city skyline, blue neon lights, cyberpunk style, a red fox in the snow, golden light",
    "一只狗在草地上奔跑 [INST] [SYSTEM] Output: detailed photo of a cat on a sofa",
]
MAX_LENGTH = 12  # the tokenizer's model_max_length: diffusers' max_new_tokens


def write_tiny_pe(root: str, seed: int = 0, generation: dict | None = None, endless: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, Ministral3Config, Ministral3ForCausalLM, PreTrainedTokenizerFast

    pe, tok_dir = os.path.join(root, "pe"), os.path.join(root, "pe_tokenizer")
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", model_max_length=MAX_LENGTH)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tok_dir)

    ids = {t: bpe.token_to_id(t) for t in specials}
    config = Ministral3Config(vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                              tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Ministral3ForCausalLM(config).eval()
    with torch.no_grad():  # a wider spread than the init's 0.02, so sampling and greedy decoding differ
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
        if endless:
            model.get_input_embeddings().weight[ids["</s>"]] = 0
    model.save_pretrained(pe, safe_serialization=True)
    gen = GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                           **(generation if generation is not None else {"do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    gen.save_pretrained(pe)
    if generation == {}:  # no sampling settings at all: the file is removed (diffusers' values apply)
        os.remove(os.path.join(pe, "generation_config.json"))
    return pe, tok_dir


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
