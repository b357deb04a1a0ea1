"""Ending sequences early: Cancel (through any coordinator) and client disconnects stop a sequence
after its round in flight and free its KV on both services (or on the one that holds both, with a
run of tree rounds in flight); SIGTERM-style drain lets in-flight streams finish while refusing new
ones."""

import asyncio
import threading

import grpc
import pytest

from services.engine.engine import GenerationRequest
from services.rpc import codec
from services.rpc import server as rpc_server
from services.rpc.channel import open_channel
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from tests.pipeline import start_pipeline, wait_until

LONG = codec.encode_generation_request(GenerationRequest((1, 2, 3), 400))


@pytest.fixture(scope="module", params=[False, True], ids=["split", "colocated"])
def pipeline(model_dirs, redis_url, request):
    """The split pipeline, and a verifier that drafts too (its fixed tree: runs of tree rounds, which a
    cancel, a disconnect or a drain must stop like a round)."""
    p = start_pipeline(model_dirs, redis_url, colocate=request.param)
    yield p
    p.close()


def kv_free(p) -> bool:
    return p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0


def test_cancel_through_another_coordinator(pipeline, redis_url):
    _, other = pipeline.add_coordinator(redis_url)
    stream = pipeline.coordinator_stub().Generate(LONG, timeout=60)
    first, second = next(stream), next(stream)
    seq_id = first.sequence_id
    assert pipeline.verifier.num_sequences == 1 and pipeline.drafter.drafter.num_sequences == 1
    with open_channel(other, 1 << 22) as ch:
        reply = coordinator_grpc.CoordinatorStub(ch).Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=10)
    assert reply.status == cpb.SEQUENCE_STATUS_RUNNING  # requested; takes effect after the round in flight
    rest = list(stream)
    messages = [first, second, *rest]
    assert rest and rest[-1].finish_reason == "cancel"
    assert all(m.finish_reason == "" for m in messages[:-1])
    streamed = [t for m in messages for t in m.tokens]
    assert len(streamed) < 400
    wait_until(lambda: kv_free(pipeline))
    state = pipeline.coordinator.store.get(seq_id)
    assert (state.status, state.finish_reason) == ("cancelled", "cancel")
    assert state.tokens == streamed  # Redis holds exactly what was streamed
    again = pipeline.coordinator_stub().Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=10)
    assert again.status == cpb.SEQUENCE_STATUS_CANCELLED


def test_client_disconnect_frees_the_kv(pipeline):
    stream = pipeline.coordinator_stub().Generate(LONG, timeout=60)
    seq_id = next(stream).sequence_id
    next(stream)
    stream.cancel()  # the client goes away
    wait_until(lambda: pipeline.coordinator.store.get(seq_id).status == "cancelled")
    # the engine releases the KV, then the run leaves the coordinator's table: wait for both
    wait_until(lambda: kv_free(pipeline) and len(pipeline.coordinator.sequences) == 0)


def test_drain_finishes_in_flight_streams_and_refuses_new_ones(pipeline, redis_url):
    coordinator, address = pipeline.add_coordinator(redis_url)
    server = pipeline.servers[-1][0]
    ch = open_channel(address, 1 << 22)
    stub = coordinator_grpc.CoordinatorStub(ch)
    stream = stub.Generate(codec.encode_generation_request(GenerationRequest((4, 5), 120)), timeout=60)
    messages = [next(stream)]
    # an event set once server.stop has begun (its first step refuses new calls), instead of a sleep
    refusing = threading.Event()
    stop = server.stop

    async def stop_and_signal(grace):
        task = asyncio.ensure_future(stop(grace))
        await asyncio.sleep(0)  # the task ran its first step: shutdown has begun
        refusing.set()
        await task

    server.stop = stop_and_signal
    # and the client's side of it: the server's GOAWAY takes this channel out of READY (the stream in
    # flight goes on; a new call needs a new connection, which the stopped listener refuses)
    goaway = threading.Event()
    ch.subscribe(lambda state: refusing.is_set() and state != grpc.ChannelConnectivity.READY and goaway.set())
    drained = threading.Thread(target=lambda: pipeline.loop.run(rpc_server.drain(server, 30.0)))
    drained.start()
    assert refusing.wait(10) and goaway.wait(10)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(LONG, timeout=10).next()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    messages += list(stream)  # the in-flight sequence runs to its end
    drained.join(30)
    assert messages[-1].finish_reason == "length" and sum(len(m.tokens) for m in messages) == 120
    ch.close()
    pipeline.servers.pop()
    coordinator.close(5)
    wait_until(lambda: kv_free(pipeline))
