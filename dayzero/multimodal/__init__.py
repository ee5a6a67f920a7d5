"""Images for vision-language models: from what a request sends to what the engine runs.

    images.py        a request's image (PIL image, bytes, `data:` URL, `file://` path) -> an RGB PIL image,
                     within the size limits, and its content hash
    processor.py     MoonViT's preprocessing (Pillow): resize within the patch limits, pad, normalise,
                     cut into patches -> ImageInput (pixels, patch grid, placeholder count, hash)
    placeholders.py  a prompt's image placeholder tokens expanded to one per feature row -> ImagePlacement
    chat.py          image parts of chat messages -> the model's placeholder text and the images, in order
    feature_cache.py the encoder's outputs by image hash (LRU), counting the encodes
Nothing here fetches anything over the network.
"""
