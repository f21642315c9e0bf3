"""System-prompt constants shared by the data converters and the model wrappers.

These strings are model conventions: the converters bake them into the parquet's chat-message lists and the
models/ wrappers apply them when given plain-string prompts. Keep this module free of heavy imports (no torch) so
that both sides can import it cheaply.
"""

# Qwen-Image: system prompt of verl-omni's qwenimage_ocr.py converter (the pipeline drops its 34-token prefix).
QWEN_IMAGE_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:"
)

# Boogu-Image text-to-image system prompt (non-empty instruction, no input image).
BOOGU_T2I_SYSTEM_PROMPT = (
    "You are a helpful assistant that generates high-quality images based on user instructions. "
    "The instructions are as follows."
)

# Boogu-Image TI2I-unified system prompt. The released pipeline also uses it for EMPTY instructions, including the
# default negative prompt "" in text-to-image mode. Keep that quirk: "fixing" it shifts the prompt distribution.
BOOGU_TI2I_SYSTEM_PROMPT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then explain "
    "how the user's text instruction should alter or modify the image. Generate a new image that meets the user's "
    "requirements while maintaining consistency with the original input where appropriate."
)
