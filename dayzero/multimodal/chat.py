"""Image parts of chat messages -> the model's image placeholder text, and the images in order.

A message's content may be a list of parts: text ({"type": "text", "text": ...}) and images, as the
OpenAI API sends them ({"type": "image_url", "image_url": {"url": "data:..." | "file://..."}}) or as
vLLM's and transformers' offline APIs do ({"type": "image_pil", "image_pil": <PIL image>},
{"type": "image", "image": <PIL image, bytes or URL>}). Each content becomes one string, its parts in
order, every image replaced by the model's placeholder text (Kimi K2.5:
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`), which the chat template passes
through and the tokenizer turns into the placeholder token (placeholders.py expands it); the images are
returned in the order their placeholders appear.
"""

from __future__ import annotations

from dayzero.multimodal.images import ImageError

IMAGE_PARTS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil", "input_image": "image_url"}


def split_images(messages: list[dict], placeholder: str | None, model_type: str = "this model"
                 ) -> tuple[list[dict], list]:
    """(messages with string contents, the images' sources in order). placeholder None: the model reads no
    images, and an image part is an ImageError."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        pieces = []
        for j, part in enumerate(content):
            where = f"messages.{i}.content.{j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in IMAGE_PARTS:
                if placeholder is None:
                    raise ImageError(f"{where}: {model_type} reads no images (it has no vision tower); send text only")
                images.append(_source(part, kind, where))
                pieces.append(placeholder)
            else:
                raise ImageError(f"{where}: unsupported content part {kind!r}; parts are text, image_url (data: or "
                                 "file:// URLs), image or image_pil")
        out.append({**message, "content": "".join(pieces)})
    return out, images


def _source(part: dict, kind: str, where: str):
    value = part.get(IMAGE_PARTS[kind], part.get(kind))
    if IMAGE_PARTS[kind] == "image_url":
        value = value.get("url") if isinstance(value, dict) else value
        if not isinstance(value, str):
            raise ImageError(f"{where}: an image_url part needs image_url.url, a data: URL or a file:// path")
    if value is None:
        raise ImageError(f"{where}: the {kind} part holds no image")
    return value
