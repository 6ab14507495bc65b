"""Chats with images: every image-part form, datasets Image columns, and one-line errors naming the record."""

import base64
import io
import json

import datasets
import pytest
from PIL import Image

from posttrain.data import DataError, RejectLog, read_vision_samples, validate_vision_record


def _png(colour="red", size=(9, 7)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _chat(*parts, answer="3"):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_image_part_form_loads_the_same_pixels(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png("blue"))
    url = "data:image/png;base64," + base64.b64encode(_png("blue")).decode()
    records = [
        _chat({"type": "image_url", "image_url": {"url": "img/a.png"}}, {"type": "text", "text": "how many?"}),
        _chat({"type": "image_url", "image_url": url}, "how many?"),
        _chat({"type": "image", "image": str(tmp_path / "img" / "a.png")}, {"type": "text", "text": "how many?"}),
        _chat({"type": "image", "url": f"file://{tmp_path / 'img' / 'a.png'}"}, {"type": "text", "text": "x"}),
        {**_chat({"type": "image"}, {"type": "text", "text": "x"}), "images": [url]},
    ]
    samples = read_vision_samples(_write(tmp_path / "train.jsonl", records))
    assert [len(s.images) for s in samples] == [1] * 5
    for sample in samples:
        image = sample.images[0]
        assert image.mode == "RGB" and image.size == (9, 7) and image.getpixel((0, 0)) == (0, 0, 255)
        assert sample.messages[0]["content"][0] == {"type": "image"}
        assert sample.messages[1]["content"] == [{"type": "text", "text": "3"}]
    assert samples[0].messages[0]["content"][1] == {"type": "text", "text": "how many?"}
    assert samples[3].metadata.origin.endswith("train.jsonl:4")


def test_bytes_pil_and_datasets_image_column(tmp_path):
    direct = validate_vision_record(_chat({"type": "image", "image": _png("green")}, {"type": "image",
                                          "image": Image.new("L", (4, 4), 255)}))
    assert [im.getpixel((0, 0)) for im in direct.images] == [(0, 128, 0), (255, 255, 255)]
    features = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
    })
    rows = {"images": [[Image.new("RGB", (5, 5), "red"), Image.new("RGB", (6, 6), "white")]],
            "messages": [[{"role": "user", "content": [{"type": "image", "text": None}, {"type": "image", "text": None},
                                                        {"type": "text", "text": "which is red?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "the first"}]}]]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    [sample] = read_vision_samples(str(tmp_path / "ds"))
    assert [im.size for im in sample.images] == [(5, 5), (6, 6)]
    assert sample.images[0].getpixel((2, 2)) == (255, 0, 0)
    assert sample.messages[0]["content"][2] == {"type": "text", "text": "which is red?"}


@pytest.mark.parametrize("part, expected", [
    ({"type": "image_url", "image_url": {"url": "gone.png"}}, "messages[0].content[0]: no such image file 'gone.png'"),
    ({"type": "image_url", "image_url": {"url": "bad.png"}}, "messages[0].content[0]: 'bad.png' is not an image"),
    ({"type": "image_url", "image_url": {"url": "cut.png"}}, "messages[0].content[0]: 'cut.png' is corrupt or trunc"),
    ({"type": "image_url", "image_url": {"url": "pic.ico"}}, "messages[0].content[0]: 'pic.ico': unsupported image "
                                                              "format ICO"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "payload is not valid base64"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}, "remote image URLs are not fetched"),
    ({"type": "image"}, "messages[0].content[0]: an {type: image} part without data needs a next image"),
    ({"type": "audio", "audio": "x.wav"}, "messages[0].content[0]: expected a text part or an image part"),
])
def test_bad_images_are_one_line_errors_naming_the_record(tmp_path, part, expected):
    (tmp_path / "bad.png").write_bytes(b"not an image at all")
    (tmp_path / "cut.png").write_bytes(_png(size=(64, 64))[:60])
    Image.new("RGB", (16, 16)).save(tmp_path / "pic.ico", format="ICO")
    path = _write(tmp_path / "train.jsonl", [_chat("fine"), _chat(part)])
    with pytest.raises(DataError) as error:
        read_vision_samples(path)
    message = str(error.value)
    assert message.startswith(f"{path}:2: ") and expected in message and "\n" not in message


def test_image_rules_and_skipping_to_the_rejects_file(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    in_answer = {"messages": [{"role": "user", "content": "draw"},
                              {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]}
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    unused = {**_chat({"type": "image"}), "images": [url, url]}
    path = _write(tmp_path / "train.jsonl", [_chat({"type": "image_url", "image_url": {"url": "a.png"}}),
                                             in_answer, unused, _chat({"type": "image_url", "image_url": "gone.png"})])
    with pytest.raises(DataError, match=r"train.jsonl:2: messages\[1\].content\[0\]: an assistant turn cannot"):
        read_vision_samples(path)
    with RejectLog(tmp_path / "rejects.jsonl") as rejects:
        kept = read_vision_samples(path, on_invalid="skip", rejects=rejects)
        assert rejects.count == 3
    assert len(kept) == 1
    lines = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [line["line"] for line in lines] == [2, 3, 4]
    assert "1 image(s) of the column are not referred to" in lines[1]["error"]
    with pytest.raises(Exception, match="1 image"):  # bytes and PIL values in memory, not only JSON
        validate_vision_record({**_chat({"type": "image"}), "images": [_png(), _png()]})


def test_posttrain_imports_without_pillow_and_says_how_to_get_it():
    import subprocess
    import sys

    code = ("import sys; sys.modules['PIL'] = None\n"  # an import of PIL now fails, as on a machine without it
            "import posttrain.data, posttrain.models, posttrain.tasks\n"
            "from posttrain.tasks import get_domain, sample_tasks\n"
            "try:\n    sample_tasks(get_domain('shape_count'), 1, level=1)\n"
            "except posttrain.data.DataError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs Pillow: pip install 'posttrain[vision]'" in done.stdout


def test_parquet_rows_with_image_structs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"images": [{"bytes": _png("black", (3, 3)), "path": None}],
             "messages": [{"role": "user", "content": [{"type": "image", "text": None},
                                                       {"type": "text", "text": "colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "black"}]}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    [sample] = read_vision_samples(tmp_path / "train.parquet")
    assert sample.images[0].getpixel((1, 1)) == (0, 0, 0) and sample.metadata.origin.endswith("train.parquet:row 0")


def test_an_image_over_the_pixel_limit_is_refused(monkeypatch):
    from posttrain.data import images

    monkeypatch.setattr(images, "_MAX_PIXELS", 50)
    with pytest.raises(Exception, match="9x7 pixels is over the 50-pixel limit"):
        validate_vision_record(_chat({"type": "image", "image": _png()}))
