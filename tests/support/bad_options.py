"""Capture options that must be refused, shared by the spec parser's tests and the live server's."""

VOCAB = 512  # the tiny test model's vocabulary (vllm_tap.tools.tiny_model.TinyLlamaSpec)

# Every option with every JSON type: the values below are invalid for the option (as the server
# sees them: JSON true arrives as 1, so where 1 is valid, true cannot be refused).
BAD = {
    "tap": ["1", "true", 1.0, 2, -1, [1], []],
    "tap_logits": [1, 1.5, [], ["full"], "FULL", "everything"],
    "tap_topk": ["5", 5.5, 5.0, [5], [], 0, -3, VOCAB + 1],
    "tap_indices": [1, "1", 1.0, [], ["1"], [1.5], [-1], [VOCAB], [[1]]],
    "tap_layers": [1, 1.0, "1", "some", [], ["1"], [1.5], [99], True],
    "tap_positions": [1, 1.0, "middle", "output[:-1]", "all[-5:10]", "output[3:3]", "output[ 1:]", [], [1], [1, 2, 3],
                      [-1, 5], [5, 2], ["output"], [1.0, 2.0]],
    "tap_dtype": [1, 1.0, [], "float64", "int8"],
    "tap_key": [5, 5.0, [], ["k"], "x" * 257, "a\x00b"],
    "tap_reducers": [1, 1.0, "tox", [], ["nope"], [1], [["tox"]]],  # the servers these run against declare no "nope"
    "tapkey": ["k", 1, []],
    "tap_layer": [[1]],
    "TAP_LAYERS": [[1]],
}
NEEDS = {"tap_topk": {"tap_logits": "topk"}, "tap_indices": {"tap_logits": "indices"}}
