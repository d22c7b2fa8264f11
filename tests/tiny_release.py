"""A tiny random ERNIE-Image release in diffusers' own layout, written by diffusers' ``save_pretrained``: the
real component classes (ErnieImageTransformer2DModel, transformers' Mistral3Model text encoder, AutoencoderKLFlux2,
FlowMatchEulerDiscreteScheduler with the release's scheduler config) at toy sizes, built from configs; a word-level
tokenizer stands in for the Tekken tokenizer, which is not available offline."""
from __future__ import annotations

import torch

from engine.models.random_weights import SIZES, random_state_dict

WORDS = ["a", "red", "cat", "on", "the", "mat", "blue", "sky", "green", "dog"]
RELEASE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 4.0, "use_dynamic_shifting": False}  # the release's


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")


def text_encoder(hidden: int, vocab: int):
    """transformers' Mistral3Model (the release's class): a 2-layer Ministral3 text tower, a 1-layer Pixtral tower."""
    import transformers

    text = transformers.Ministral3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=hidden // 4, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=16, head_dim=8)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    return transformers.Mistral3Model(cfg).eval()


def vae(latent_channels: int):
    import diffusers

    torch.manual_seed(0)
    v = diffusers.AutoencoderKLFlux2(block_out_channels=(16, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                     norm_num_groups=8, latent_channels=latent_channels)
    v.bn.running_mean.normal_()  # non-trivial statistics, so the de-normalisation matters
    v.bn.running_var.uniform_(0.5, 2.0)
    return v.eval()


def transformer(cfg=None, seed: int = 0):
    import diffusers

    cfg = cfg or SIZES["tiny"]
    ref = diffusers.ErnieImageTransformer2DModel(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
        ffn_hidden_size=cfg.ffn_hidden_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
        patch_size=cfg.patch_size, text_in_dim=cfg.text_in_dim, rope_axes_dim=tuple(cfg.rope_axes_dim),
        rope_theta=int(cfg.rope_theta), eps=cfg.eps)
    ref.load_state_dict(random_state_dict(cfg, seed))
    return ref.eval()


def diffusers_pipeline():
    """diffusers' ErnieImagePipeline on the tiny components (no PE)."""
    import diffusers

    cfg = SIZES["tiny"]
    tok = tokenizer()
    return diffusers.ErnieImagePipeline(
        transformer=transformer(cfg), vae=vae(cfg.in_channels // 4), text_encoder=text_encoder(cfg.text_in_dim, len(tok)),
        tokenizer=tok, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**RELEASE_SCHEDULER))


def write_release(folder) -> str:
    """The tiny release saved by diffusers itself (model_index.json and the seven-folder layout minus pe/)."""
    diffusers_pipeline().save_pretrained(str(folder), safe_serialization=True)
    return str(folder)
