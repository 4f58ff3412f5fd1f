"""inflight.chat.images: every way an image part may hold an image decodes to the pixels PIL made, and
every bad one is an ImageError naming the fault, with the code the server answers with."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from inflight.chat.images import ImageError, ImageLimits, count_images, load_image, part_source, split_images


def picture(width: int = 7, height: int = 5, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))


def test_every_source_gives_the_same_pixels(tmp_path):
    image = picture()
    png = encoded(image)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(png)
    local = ImageLimits(local_root=tmp_path, bare_base64=True)
    sources = [
        data_url(png),
        png,
        bytearray(png),
        {"bytes": png, "path": None},
        {"bytes": None, "path": "sub/a.png"},
        "sub/a.png",
        f"file://{tmp_path}/sub/a.png",
        str(tmp_path / "sub" / "a.png"),
        base64.b64encode(png).decode(),
        image,
    ]
    for source in sources:
        got = load_image(source, local, base_dir=tmp_path)
        assert got.mode == "RGB" and same_pixels(got, image), repr(source)[:40]


def test_jpeg_decodes_as_pil_decodes_it():
    jpeg = encoded(picture(16, 9), "JPEG")
    assert same_pixels(load_image(data_url(jpeg, "image/jpeg")), Image.open(io.BytesIO(jpeg)))


def test_rgba_and_grayscale_become_rgb():
    rgba = Image.new("RGBA", (3, 2), (10, 20, 30, 128))
    gray = Image.new("L", (3, 2), 77)
    assert load_image(encoded(rgba)).getpixel((0, 0)) == rgba.convert("RGB").getpixel((0, 0))
    assert load_image(encoded(gray)).getpixel((1, 1)) == (77, 77, 77)


@pytest.mark.parametrize("source, code, words", [
    ("https://example.com/cat.png", "image_url_not_allowed", "no network access"),
    ("http://example.com/cat.png", "image_url_not_allowed", "data: URL"),
    ("file:///etc/hostname", "image_url_not_allowed", "--allowed-local-media-path"),
    ("/etc/hostname", "image_url_not_allowed", "--allowed-local-media-path"),
    ("ftp://host/a.png", "image_url_not_allowed", "scheme 'ftp'"),
    ("data:image/png,notbase64", "invalid_image", "must be base64"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image", "not an image"),
    ("data:image/png;base64,@@@@", "invalid_image", "not valid base64"),
    (data_url(b"hello, not an image"), "invalid_image", "unreadable image"),
    (data_url(encoded(picture())[:60]), "invalid_image", "corrupt or truncated"),
    ("", "invalid_image", "no image"),
    (None, "invalid_image", "no image"),
    (12, "invalid_image", "no image"),
])
def test_bad_sources_name_the_fault(source, code, words):
    with pytest.raises(ImageError, match=words) as err:
        load_image(source)
    assert err.value.code == code


def test_limits_pixels_from_the_header_and_bytes():
    big = encoded(Image.new("RGB", (300, 200)))
    with pytest.raises(ImageError, match=r"300x200 = 60000 pixels, over the limit of 59999") as err:
        load_image(big, ImageLimits(max_pixels=59999))
    assert err.value.code == "image_too_large"
    assert load_image(big, ImageLimits(max_pixels=60000)).size == (300, 200)
    with pytest.raises(ImageError, match=f"{len(big)} bytes, over the limit of {len(big) - 1} bytes") as err:
        load_image(big, ImageLimits(max_bytes=len(big) - 1))
    assert err.value.code == "image_too_large"
    assert load_image(big, ImageLimits(max_bytes=None, max_pixels=None)).size == (300, 200)
    with pytest.raises(ImageError, match="pixels"):  # a decoded image too
        load_image(Image.new("RGB", (10, 10)), ImageLimits(max_pixels=99))
    with pytest.raises(ValueError, match="max_pixels=0 must be a positive integer"):
        ImageLimits(max_pixels=0)


def test_local_files_stay_under_their_root(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside.png").write_bytes(encoded(picture()))
    limits = ImageLimits(local_root=tmp_path / "root")
    with pytest.raises(ImageError, match="outside") as err:
        load_image("../outside.png", limits, base_dir=tmp_path / "root")
    assert err.value.code == "image_url_not_allowed"
    with pytest.raises(ImageError, match="cannot read image file"):
        load_image("missing.png", limits, base_dir=tmp_path / "root")
    with pytest.raises(ImageError, match="neither an image file"):
        load_image("missing.png", ImageLimits(local_root=tmp_path, bare_base64=True), base_dir=tmp_path)


def test_animated_gif_refused():
    frames = [picture(seed=s) for s in range(2)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageError, match="animated"):
        load_image(buf.getvalue())


def test_parts_and_split_messages():
    png, other = encoded(picture()), encoded(picture(4, 4, seed=1))
    assert part_source({"type": "image_url", "image_url": {"url": "u"}}) == "u"
    assert part_source({"type": "image_url", "image_url": "u"}) == "u"
    assert part_source({"type": "input_image", "image_url": "u", "detail": "auto"}) == "u"
    assert part_source({"type": "image", "image": png}) == png
    assert part_source({"type": "image", "path": "p.png"}) == "p.png"
    with pytest.raises(ImageError, match="stores no files"):
        part_source({"type": "input_image", "file_id": "file-1"})
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": data_url(png)}},
                                             {"type": "image", "image": other}]}]
    assert count_images(messages) == 2
    split = split_images(messages)
    assert split.messages[0] == messages[0]
    assert split.messages[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "image"},
    ]
    assert [
        same_pixels(a, b) for a, b in zip(split.images, [picture(), picture(4, 4, seed=1)], strict=True)
    ] == [True] * 2
    assert messages[1]["content"][1]["type"] == "image_url"  # the input is left as it was
    bad = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[1\]: cannot fetch") as err:
        split_images(bad)
    assert err.value.where == "messages[0].content[1]" and err.value.code == "image_url_not_allowed"
