"""Tiny vision-language models of the installed transformers, each with a real image through its vision tower, for
the integrations' tests: ``FAMILIES`` maps a family to a builder returning ``(model, inputs)``, where ``inputs``
holds ``input_ids`` (text around the image's placeholder tokens, as the family's processor lays them out) and the
family's pixel arguments."""

import inspect

import torch

V = 320  # the text vocabulary; the image's placeholder token is IMAGE, its delimiters just below
IMAGE, VISION_START, VISION_END, VIDEO = V - 20, V - 19, V - 18, V - 17
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)  # fmt: skip


def _image(*shape, seed=5):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qwen_vl(config_name, vision, text_rope, patch=14):
    def build(transformers):
        config = getattr(transformers, config_name)(
            text_config=dict(TEXT, rope_scaling=text_rope), vision_config=vision, image_token_id=IMAGE,
            video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        )  # fmt: skip
        # one 4 x 4 grid of patches (2 frames each), 4 tokens after the 2 x 2 merge
        pixels = dict(pixel_values=_image(16, 3 * 2 * patch * patch), image_grid_thw=torch.tensor([[1, 4, 4]]))
        return config, pixels, [VISION_START] + [IMAGE] * 4 + [VISION_END]

    return build


def _counted(config_name, pixels, **config):
    """A family whose image becomes as many placeholder tokens as its projector gives features (counted by the
    model's own get_image_features)."""

    def build(transformers):
        return getattr(transformers, config_name)(**config), pixels(), None

    return build


MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}
_BUILDERS = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", _qwen_vl(
        "Qwen2VLConfig", dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                              temporal_patch_size=2, in_channels=3, mlp_ratio=2), MROPE)),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", _qwen_vl(
        "Qwen2_5_VLConfig", dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                                 window_size=56, fullatt_block_indexes=[1]), MROPE)),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", _qwen_vl(
        "Qwen3VLConfig", dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                              patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                              num_position_embeddings=16, deepstack_visual_indexes=[1]),
        {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}, patch=16)),
    "llava": ("LlavaForConditionalGeneration", _counted(
        "LlavaConfig", lambda: dict(pixel_values=_image(1, 3, 28, 28)), image_token_id=IMAGE,
        projector_hidden_act="gelu", vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
        text_config=dict(TEXT, model_type="llama"))),
    "llava_next": ("LlavaNextForConditionalGeneration", _counted(
        "LlavaNextConfig", lambda: dict(pixel_values=_image(1, 3, 3, 28, 28), image_sizes=torch.tensor([[28, 56]])),
        image_token_id=IMAGE, projector_hidden_act="gelu", image_grid_pinpoints=[[28, 28], [28, 56]],
        vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
        text_config=dict(TEXT, model_type="llama"))),
    "paligemma": ("PaliGemmaForConditionalGeneration", _counted(
        "PaliGemmaConfig", lambda: dict(pixel_values=_image(1, 3, 28, 28)), image_token_id=IMAGE, projection_dim=64,
        hidden_size=64, vision_config=dict(VISION, model_type="siglip_vision_model", projection_dim=64),
        text_config=dict(TEXT, model_type="gemma"))),
    "idefics3": ("Idefics3ForConditionalGeneration", _counted(
        "Idefics3Config", lambda: dict(pixel_values=_image(1, 1, 3, 28, 28)), image_token_id=IMAGE, scale_factor=2,
        vision_config=VISION, text_config=dict(TEXT, model_type="llama"))),
    "smolvlm": ("SmolVLMForConditionalGeneration", _counted(
        "SmolVLMConfig", lambda: dict(pixel_values=_image(1, 1, 3, 28, 28)), image_token_id=IMAGE, scale_factor=2,
        vision_config=VISION, text_config=dict(TEXT, model_type="llama"))),
    "internvl": ("InternVLForConditionalGeneration", _counted(
        "InternVLConfig", lambda: dict(pixel_values=_image(1, 3, 28, 28)), image_token_id=IMAGE, downsample_ratio=0.5,
        vision_config=dict(VISION, image_size=[28, 28], patch_size=[14, 14]),
        text_config=dict(TEXT, model_type="qwen2"))),
    "gemma3": ("Gemma3ForConditionalGeneration", _counted(
        "Gemma3Config", lambda: dict(pixel_values=_image(1, 3, 56, 56)), image_token_index=IMAGE,
        mm_tokens_per_image=4, vision_config=dict(VISION, model_type="siglip_vision_model", image_size=56),
        text_config=dict(TEXT, model_type="gemma3_text"))),
    "mllama": ("MllamaForConditionalGeneration", _counted(
        "MllamaConfig", lambda: dict(pixel_values=_image(1, 1, 2, 3, 28, 28), aspect_ratio_ids=torch.tensor([[2]]),
                                     aspect_ratio_mask=torch.tensor([[[1, 1]]])),
        image_token_index=IMAGE,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2,
                           intermediate_layers_indices=[0], vision_output_dim=64,
                           supported_aspect_ratios=[[1, 1], [1, 2]]),
        text_config=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1], bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, rope_scaling={"rope_type": "default"}))),
}  # fmt: skip


def _feature_tokens(model, pixels):
    """How many placeholder tokens the image takes: the rows of the features the model's own
    get_image_features gives."""
    get = getattr(model, "get_image_features", None) or model.model.get_image_features
    accepted = inspect.signature(get).parameters
    features = get(**{k: v for k, v in pixels.items() if k in accepted})
    features = getattr(features, "pooler_output", None) if not torch.is_tensor(features) and not isinstance(
        features, (list, tuple)) else features  # fmt: skip
    if isinstance(features, (list, tuple)):
        return sum(f.numel() // f.shape[-1] for f in features)
    return features.numel() // features.shape[-1]


def build(transformers, family, seed=0):
    """(model, inputs): the family's tiny model (float32, eval) and a batch of one image and 20 text tokens."""
    class_name, builder = _BUILDERS[family]
    config, pixels, placeholder = builder(transformers)
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config).float().eval()
    text = torch.randint(3, IMAGE, (20,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    if family == "mllama":  # an <|image|> token first, then text; its cross-attention mask over the image's tiles
        ids = torch.tensor([[IMAGE] + text])
        pixels["cross_attention_mask"] = torch.ones(1, ids.shape[1], 1, 2, dtype=torch.long)
    else:
        if placeholder is None:
            with torch.no_grad():
                placeholder = [IMAGE] * _feature_tokens(model, pixels)
        ids = torch.tensor([text[:6] + placeholder + text[6:]])
    inputs = dict(input_ids=ids, **pixels)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # (Qwen-VL's M-RoPE, transformers 5)
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()
    return model, inputs


FAMILIES = list(_BUILDERS)
