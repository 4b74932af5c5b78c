"""Generated protobuf code is committed; regenerating it must give no difference."""

from pathlib import Path

from llmserve import protogen
from llmserve.v1 import inference_pb2


def test_regeneration_gives_no_diff(tmp_path: Path):
    protogen.generate(tmp_path)
    committed = protogen.REPO_ROOT / "llmserve" / "v1"
    generated = sorted((tmp_path / "llmserve" / "v1").glob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for path in generated:
        assert path.read_text() == (committed / path.name).read_text(), f"{path.name} is stale: make protos"


def test_public_contract_names():
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert [m.name for m in service.methods] == ["Generate", "Complete", "Cancel", "Tokenize", "ListModels"]
    assert inference_pb2.FinishReason.Name(3) == "FINISH_REASON_CANCELLED"
    assert inference_pb2.Priority.Name(0) == "PRIORITY_UNSPECIFIED"
    fields = inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert set(fields) == {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed", "repetition_penalty",
                           "ignore_eos", "response_format", "top_logprobs", "logprobs"}
    kind = inference_pb2.ResponseFormat.DESCRIPTOR.oneofs_by_name["kind"]
    assert [f.name for f in kind.fields] == ["json_schema", "regex", "choice", "json_object"]
    assert list(inference_pb2.ChoiceList.DESCRIPTOR.fields_by_name) == ["choices"]


def test_this_rounds_public_names():
    """DESIGN.md's additions (tools, logprobs, n, SLOs, model facts) keep their names."""
    assert inference_pb2.FinishReason.Name(4) == "FINISH_REASON_TOOL_CALLS"
    request = inference_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert {"tools", "tool_choice", "n", "slo_ttft_ms", "slo_tpot_ms"} <= set(request)
    assert list(inference_pb2.Tool.DESCRIPTOR.fields_by_name) == [
        "name", "description", "parameters_json_schema", "strict"]
    choice = inference_pb2.ToolChoice.DESCRIPTOR.oneofs_by_name["kind"]
    assert [f.name for f in choice.fields] == ["none", "auto", "required", "function_name"]
    assert {"tool_calls", "tool_call_id"} <= set(inference_pb2.ChatMessage.DESCRIPTOR.fields_by_name)
    assert list(inference_pb2.ToolCall.DESCRIPTOR.fields_by_name) == ["id", "name", "arguments_json"]
    for message in (inference_pb2.GenerateResponse, inference_pb2.CompleteResponse):
        assert {"tool_calls", "logprobs", "choice_index"} <= set(message.DESCRIPTOR.fields_by_name)
    assert list(inference_pb2.TokenLogprob.DESCRIPTOR.fields_by_name) == ["token_id", "token", "logprob", "top"]
    assert list(inference_pb2.TopLogprob.DESCRIPTOR.fields_by_name) == ["token_id", "token", "logprob"]
    assert {"architecture", "weight_format"} <= set(inference_pb2.ModelInfo.DESCRIPTOR.fields_by_name)
