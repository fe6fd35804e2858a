//! The NCCL group at world size 1 on one GPU: the host entry points against the f64 reference of
//! `comm_support` (the whole matrix every backend runs), and the device entry points against the
//! same reference after copying back. Skipped, with a note, where no GPU or no NCCL is found.
#![cfg(feature = "cuda")]

mod comm_support;

use comm_support::{assert_close, exercise, input, reference, EXERCISE_COUNT};
use cudarc::driver::CudaContext;
use std::sync::Arc;
use std::time::Duration;
use zero_core::comm::{DType, FlatBuffer, NcclGroup, ProcessGroup, ReduceOp, Subject, TcpGroup, TcpOptions};

/// Skips a test where there is no GPU or no NCCL, with the reason printed; fails instead under
/// `ZERO_REQUIRE_CUDA=1` (tools/gpu/run.sh), where a skip would hide a broken CUDA setup.
fn skip(why: String) {
    assert!(
        std::env::var_os("ZERO_REQUIRE_CUDA").is_none(),
        "ZERO_REQUIRE_CUDA is set: {why}"
    );
    eprintln!("skipped: {why}");
}

/// A one-rank NCCL group on GPU 0, or `None` (with the reason printed) where there is none.
fn single_rank() -> Option<NcclGroup> {
    let count = std::panic::catch_unwind(CudaContext::device_count);
    match count {
        Ok(Ok(n)) if n > 0 => {}
        other => {
            skip(format!("no CUDA device found ({other:?})"));
            return None;
        }
    }
    let options = TcpOptions {
        timeout: Duration::from_secs(60),
        ..TcpOptions::default()
    };
    // World size 1 needs no rendezvous peer: the port is never opened.
    let ctrl = TcpGroup::connect(0, 1, "127.0.0.1", 1, options).expect("a one-rank TCP group");
    match NcclGroup::over(Arc::new(ctrl), 0, Duration::from_secs(60)) {
        Ok(g) => Some(g),
        Err(e) => {
            skip(format!("NCCL is unusable here: {e}"));
            None
        }
    }
}

#[test]
fn host_entry_points_match_the_reference() {
    let Some(g) = single_rank() else { return };
    assert_eq!(exercise(&g), EXERCISE_COUNT);
    // reduce_scatter_into, which `exercise` does not cover.
    let mut inp = FlatBuffer::from_f32(&input(0, 1001, 5), DType::BF16);
    let mut out = FlatBuffer::zeros(DType::BF16, 1001);
    g.reduce_scatter_into(&mut inp, &mut out, ReduceOp::Avg)
        .expect("reduce_scatter_into");
    let (want, scale) = reference(1, 1001, 5, DType::BF16, ReduceOp::Avg);
    assert_close(&out, &want, &scale, DType::BF16, ReduceOp::Avg, "reduce_scatter_into");
}

#[test]
fn device_entry_points_match_the_reference() {
    let Some(g) = single_rank() else { return };
    let stream = g.stream().expect("the group's stream");
    // The caller's compute stream: a separate one, so the event contract is exercised.
    let compute = stream.context().new_stream().expect("a compute stream");
    let len = 4099;
    let host = input(0, len, 9);

    let mut buf = compute.clone_htod(&host).expect("upload");
    let ready = compute.record_event(None).expect("event");
    let done = g
        .all_reduce_device(&mut buf, ReduceOp::Sum, Some(&ready))
        .expect("all_reduce_device");
    compute.wait(&done).expect("wait");
    let got = compute.clone_dtoh(&buf).expect("download");
    compute.synchronize().expect("sync");
    let (want, scale) = reference(1, len, 9, DType::F32, ReduceOp::Sum);
    assert_close(
        &FlatBuffer::F32(got),
        &want,
        &scale,
        DType::F32,
        ReduceOp::Sum,
        "all_reduce_device",
    );

    let full = compute.clone_htod(&host).expect("upload");
    let mut shard = compute.alloc_zeros::<f32>(len).expect("alloc");
    let ready = compute.record_event(None).expect("event");
    let done = g
        .reduce_scatter_device(&full, &mut shard, ReduceOp::Max, Subject::Unit(0), Some(&ready))
        .expect("reduce_scatter_device");
    compute.wait(&done).expect("wait");
    let got = compute.clone_dtoh(&shard).expect("download");
    compute.synchronize().expect("sync");
    let (want, scale) = reference(1, len, 9, DType::F32, ReduceOp::Max);
    assert_close(
        &FlatBuffer::F32(got),
        &want,
        &scale,
        DType::F32,
        ReduceOp::Max,
        "reduce_scatter_device",
    );

    let part = compute.clone_htod(&host).expect("upload");
    let mut gathered = compute.alloc_zeros::<f32>(len).expect("alloc");
    let ready = compute.record_event(None).expect("event");
    let done = g
        .all_gather_device(&part, &mut gathered, Subject::Unit(0), Some(&ready))
        .expect("all_gather_device");
    // Waited for on the host this time, under the group's timeout.
    g.wait_device(&done).expect("wait_device");
    let got = compute.clone_dtoh(&gathered).expect("download");
    compute.synchronize().expect("sync");
    assert_eq!(got, host, "all_gather_device at world size 1 returns the shard");

    // A wrong output length is refused before anything is enqueued.
    let mut short = compute.alloc_zeros::<f32>(len - 1).expect("alloc");
    assert!(g.all_gather_device(&part, &mut short, Subject::Unnamed, None).is_err());
}
