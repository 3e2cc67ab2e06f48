"""moepass/harness/output.py: result files stay valid JSON; errors shrink to one line."""

from moepass.harness import output


def test_nan_loss_is_written_as_null():
    assert output.json_safe({"a": [1.0, float("nan")], "b": float("inf")}) == {"a": [1.0, None], "b": None}


def test_error_summary_joins_dynamo_header_to_the_cause():
    err = "BackendCompilerFailed: backend='moepass' raised:\nAttributeError: no dtype\n\nSet TORCHDYNAMO_VERBOSE=1"
    assert output.error_summary(err) == "BackendCompilerFailed: backend='moepass' raised: AttributeError: no dtype"
    assert output.error_summary("ValueError: bad\nmore") == "ValueError: bad"
