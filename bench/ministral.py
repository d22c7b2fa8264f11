"""ERNIE-Image's text encoder at its real shape for the benchmarks that build it without its files: the Ministral 3
3B text tower (shared/reference/ernie_image.md), and a stand-in for its tokenizer that only sets a prompt's length
(the Tekken files are not available offline). bench/memory/parts.py traces it; bench/gpu/gpu_check_parts.py runs it."""

MINISTRAL_3B = dict(vocab_size=131072, hidden_size=3072, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


class CountOnly:
    """A prompt of ``tokens`` ids, BOS first."""

    bos_token_id = 1

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __call__(self, prompt, **kw):
        return {"input_ids": [1] * self.tokens}
