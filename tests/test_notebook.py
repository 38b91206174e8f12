"""Results in a real Jupyter kernel (nbclient): each result's `_repr_html_` is the reading's own picture
(inspect's bars and targets, generate's text with each step on hover, diff's two sides, lens's layers × positions map,
calibrate's diagram), holding the tokens and figures of its `to_dict()`, every text HTML-escaped.

The kernel is this interpreter, through a kernel spec written in a temporary folder, so the test needs
nothing installed beyond ipykernel; it is skipped, with the reason, only when no kernel can start."""

from __future__ import annotations

import html
import json
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from lmhead_cli.render import show_token  # noqa: E402

PROMPT = "In the beginning <b>God</b>"  # markup in the data: shown, never parsed
CELLS = {
    "inspect": f"r = m.inspect({PROMPT!r}, top_k=4, targets=[' created', ' <i>'])",
    "generate": "r = m.generate('In the beginning', max_new_tokens=6, seed=3, show_steps=2)",
    "diff": f"r = m.diff({PROMPT!r}, 'And God said', top_k=3)",
    "lens": f"r = m.lens({PROMPT!r}, targets=[' created'], top_k=3)",
    "calibrate": "r = m.calibrate('Now the word of the LORD came unto Jonah the son of Amittai, saying, Arise, go to "
                 "Nineveh, that great city, and cry against it; for their wickedness is come up before me.')",
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """{name: (to_dict() as the kernel printed it, the cell's text/html)} for each of CELLS."""
    folder = tmp_path_factory.mktemp("kernel")
    spec = folder / "kernels" / "lmhead-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lmhead test", "language": "python"}))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(folder))
    mp.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import json, lmhead_cli\nm = lmhead_cli.load('bundled:tiny', device='cpu')")]
    nb.cells += [nbformat.v4.new_code_cell(f"{code}\nprint(json.dumps(r.to_dict()))\nr") for code in CELLS.values()]
    client = nbclient.NotebookClient(nb, kernel_name="lmhead-test", timeout=900,
                                     resources={"metadata": {"path": str(folder)}})
    try:
        client.km = client.create_kernel_manager()
        client.start_new_kernel()
        client.start_new_kernel_client()
    except Exception as e:  # noqa: BLE001 - no kernel here: say why
        mp.undo()
        pytest.skip(f"no Jupyter kernel could start: {type(e).__name__}: {e}")
    try:
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
    finally:
        client._cleanup_kernel()
        mp.undo()
    got = {}
    for name, cell in zip(CELLS, nb.cells[1:]):
        printed = "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stdout")
        (shown,) = [o["data"]["text/html"] for o in cell.outputs if o["output_type"] == "execute_result"]
        got[name] = (json.loads(printed), shown)
    return got


def shown(text: str) -> str:
    """A token as the views show it: visible (show_token), then HTML-escaped."""
    return html.escape(show_token(text), quote=True)


def exact(value) -> str:
    return f"title='{value!r}'"


def not_the_json_table(view: str) -> None:
    assert "<th style='text-align:left'>random_weights</th>" not in view  # the old key/value table


def test_inspect_shows_the_top_k_with_bars_and_the_targets(outputs):
    doc, view = outputs["inspect"]
    not_the_json_table(view)
    assert "<b>God</b>" not in view and shown(" <") in view and "&lt;i&gt;" in view
    for t in doc["top"]:
        assert shown(t["token"]) in view and exact(t["prob"]) in view and exact(t["logit"]) in view
    assert view.count("width:10em;background") == len(doc["top"]) + len(doc["targets"])  # a bar each
    for t in doc["targets"]:
        assert shown(t["token"]) in view and exact(t["rank"]) in view and exact(t["prob"]) in view
    assert exact(doc["entropy"]) in view


def test_generate_shows_the_text_with_each_step_on_hover(outputs):
    doc, view = outputs["generate"]
    not_the_json_table(view)
    steps = view.split("class='step'")[1:]
    assert len(steps) == len(doc["steps"]) == 6
    for s, piece in zip(doc["steps"], steps):
        assert f"prob {s['prob']!r}" in piece and f"rank {s['rank']}" in piece and f"entropy {s['entropy']!r}" in piece
        assert all(f"{html.escape(show_token(a['token']), quote=True)} {a['prob']!r}" in piece for a in s["alternatives"])
        assert f">{html.escape(s['token'])}</span>" in piece
    assert html.escape(doc["prompt"]) in view


def test_diff_shows_the_two_distributions_side_by_side(outputs):
    doc, view = outputs["diff"]
    not_the_json_table(view)
    a, b = view.index("<b>a</b>"), view.index("<b>b</b>")
    assert a < b and "display:flex" in view[:a]
    for key, part in (("a", view[a:b]), ("b", view[b:])):
        assert html.escape(doc[key]["prompt"]) in part
        for t in doc[key]["top"]:
            assert shown(t["token"]) in part and exact(t["prob"]) in part and exact(t["other_rank"]) in part
    assert all(exact(doc[k]) in view for k in ("kl_ab", "kl_ba", "js", "tv"))


def test_lens_shows_a_layer_by_position_map_of_the_top_tokens(outputs):
    """Rows = layers, columns = prompt positions; each cell the `grid` cell of to_dict(): that layer's
    top token there, its exact probability on hover and as the shade; then the layers' rows at the
    position read, with the target's probability."""
    doc, view = outputs["lens"]
    not_the_json_table(view)
    grid = view[view.index("lmhead-lens-grid"):view.index("</table>")]
    rows = grid.split("<tr>")[2:]  # after the header
    assert len(rows) == len(doc["layers"]) == len(doc["grid"])
    assert doc["grid_start"] == 0 and all(len(r) == len(doc["prompt_tokens"]) for r in doc["grid"])
    for row, cells in zip(rows, doc["grid"]):
        got = row.split("<td")[1:]
        assert len(got) == len(cells)
        for td, c in zip(got, cells):
            assert f"data-id='{c['id']}' data-prob='{c['prob']!r}'" in td
            assert f"background:rgba(72,120,208,{c['prob']:.3f})" in td and f">{shown(c['token'])}</td>" in td
    header = grid.split("<tr>")[1]
    assert [h.split(">", 1)[1].split("</th>")[0] for h in header.split("<th")[2:]] == \
        [shown(t["text"]) for t in doc["prompt_tokens"]]
    below = view[view.index("at position"):]
    for layer, row in zip(doc["layers"], below.split("<tr>")[2:]):
        assert shown(layer["top_token"]) in row and exact(layer["top_prob"]) in row and exact(layer["entropy"]) in row
        assert all(exact(t["prob"]) in row for t in layer["targets"])
    # the column read: the last position, whose cells are the layers' rows
    assert [cells[doc["position"]]["id"] for cells in doc["grid"]] == [layer["top_id"] for layer in doc["layers"]]


def test_calibrate_shows_the_reliability_diagram(outputs):
    doc, view = outputs["calibrate"]
    assert view.count("<svg") == 2
    for b in doc["bins"]:
        if b["count"]:
            assert (f"({b['lo']:.3f}, {b['hi']:.3f}]: {b['count']:,} positions, confidence {b['confidence']:.4f}, "
                    f"accuracy {b['accuracy']:.4f}") in view
    assert f"{doc['ece']:.4f}" in view and f"{doc['temperature']:.4f}" in view and f"{doc['brier']:.4f}" in view
