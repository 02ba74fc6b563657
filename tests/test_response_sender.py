"""The host's response sender counts a request's outcome before the client can see its last
message: a client that reads the metrics right after its answer (or its error) finds it counted."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from dflash_trt.serving import pb_utils
from dflash_trt.serving.host import make_sender


@pytest.mark.parametrize("error", [False, True], ids=["answer", "error"])
def test_the_outcome_is_recorded_before_the_final_delivery(error):
    events: list[tuple] = []
    sender = make_sender(
        deliver=lambda d: events.append(("deliver", d.final, d.error is not None)),
        on_final=lambda ok, code, values: events.append(("final", ok, code)),
        on_first=lambda: events.append(("first",)),
    )
    if error:
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError("max_tokens must be >= 1",
                                                                         pb_utils.TritonError.INVALID_ARG))
    else:
        response = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([b"hi"], dtype=object))])
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    want_final = ("final", not error, grpc.StatusCode.INVALID_ARGUMENT if error else None)
    assert events == [("first",), want_final, ("deliver", True, error)]


def test_a_streamed_answer_is_delivered_as_it_comes_and_counted_once_at_the_end():
    events: list[tuple] = []
    sender = make_sender(lambda d: events.append(("deliver", d.final)),
                         lambda ok, code, values: events.append(("final", ok)), lambda: None)
    part = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([b"a"], dtype=object))])
    sender.send(part)
    sender.send(part)
    sender.send(None, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert events == [("deliver", False), ("deliver", False), ("final", True), ("deliver", True)]
