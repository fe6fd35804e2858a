//! `reduce_scatter_into`: the reduced chunk lands in the caller's output and both allocations
//! come back, on the threads and the TCP backend (TCP ranks as threads of this process), checked
//! against the f64 single-process reference of `comm_support`.

mod comm_support;

use comm_support::{assert_close, input, reference, DTYPES, OPS};
use std::sync::Arc;
use std::thread;
use std::time::Duration;
use zero_core::comm::{CommError, FlatBuffer, ProcessGroup, ReduceOp, TcpGroup, TcpOptions, ThreadGroup, Work};

/// Every dtype and op, twice in a row with the same buffers (the second call reuses what the
/// first handed back); returns the number of checked results. `whole_input`: the backend hands
/// the input's allocation back (the trait's default implementation does not).
fn exercise_into_with(g: &dyn ProcessGroup, whole_input: bool) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let len = 1001;
    let mut checked = 0;
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        for (j, op) in OPS.into_iter().enumerate() {
            let mut input_buf = FlatBuffer::zeros(dtype, 0);
            let mut out = FlatBuffer::from_f32(&vec![7.0; len], dtype);
            for round in 0..2u64 {
                let salt = 100 + 10 * i as u64 + 3 * j as u64 + round;
                let fresh = FlatBuffer::from_f32(&input(rank, len * world, salt), dtype);
                if !input_buf.copy_from(&fresh) {
                    input_buf = fresh;
                }
                let what = format!("rank {rank}/{world} reduce_scatter_into {op:?} {dtype:?} round {round}");
                g.reduce_scatter_into(&mut input_buf, &mut out, op)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let (want, scale) = reference(world, len * world, salt, dtype, op);
                let mine = rank * len..(rank + 1) * len;
                assert_close(&out, &want[mine.clone()], &scale[mine], dtype, op, &what);
                if whole_input {
                    assert_eq!(input_buf.len(), len * world, "{what}: the input comes back whole");
                }
                checked += 1;
            }
        }
    }
    checked
}

fn exercise_into(g: &dyn ProcessGroup) -> usize {
    exercise_into_with(g, true)
}

/// A group that implements only what the trait requires, over a thread group: it runs the
/// default `reduce_scatter_into_async`.
#[derive(Debug)]
struct Plain(Arc<ThreadGroup>);

impl ProcessGroup for Plain {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_async(&self, buffer: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        self.0.all_reduce_async(buffer, op)
    }
    fn reduce_scatter_async(&self, input: FlatBuffer, op: ReduceOp) -> Work<FlatBuffer> {
        self.0.reduce_scatter_async(input, op)
    }
    fn all_gather_async(&self, shard: FlatBuffer) -> Work<FlatBuffer> {
        self.0.all_gather_async(shard)
    }
    fn broadcast_async(&self, buffer: FlatBuffer, root: usize) -> Work<FlatBuffer> {
        self.0.broadcast_async(buffer, root)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.0.barrier()
    }
}

#[test]
fn the_default_reduce_scatter_into_matches_the_reference() {
    for world in 1..=3 {
        let ranks: Vec<Plain> = ThreadGroup::with_timeout(world, Duration::from_secs(60))
            .expect("group")
            .into_iter()
            .map(Plain)
            .collect();
        let counts = on_threads(ranks, |g: &Plain| exercise_into_with(g, false));
        assert_eq!(counts, vec![CHECKS; world], "world {world}");
    }
}

/// An output of the wrong length is refused, naming the op. Run on a fresh group, every rank at
/// once: the failing rank tells its peers, which would fail whatever they were doing.
fn refuses_a_wrong_output(g: &dyn ProcessGroup) -> usize {
    let (rank, world) = (g.rank(), g.world_size());
    let mut bad_in = FlatBuffer::F32(vec![0.0; 4 * world]);
    let mut bad_out = FlatBuffer::F32(vec![0.0; 3]);
    match g.reduce_scatter_into(&mut bad_in, &mut bad_out, ReduceOp::Sum) {
        Err(CommError::InvalidArgument { op, message }) => {
            assert_eq!(op, "reduce_scatter");
            assert!(message.contains("needs 4"), "{message}");
        }
        other => panic!("rank {rank}: a 3-element output for 4-element chunks: {other:?}"),
    }
    1
}

fn on_threads<G: Send + Sync>(ranks: Vec<G>, f: impl Fn(&G) -> usize + Sync) -> Vec<usize> {
    thread::scope(|s| {
        let handles: Vec<_> = ranks.iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

const CHECKS: usize = 2 * DTYPES.len() * OPS.len();

#[test]
fn thread_group_reduce_scatter_into_matches_the_reference() {
    for world in 1..=4 {
        let ranks = ThreadGroup::with_timeout(world, Duration::from_secs(60)).expect("group");
        let counts = on_threads(ranks, |g: &Arc<ThreadGroup>| exercise_into(&**g));
        assert_eq!(counts, vec![CHECKS; world], "world {world}");
        let ranks = ThreadGroup::with_timeout(world, Duration::from_secs(60)).expect("group");
        let refused = on_threads(ranks, |g: &Arc<ThreadGroup>| refuses_a_wrong_output(&**g));
        assert_eq!(refused, vec![1; world]);
    }
}

fn tcp_world(world: usize, unix_on_same_host: bool) -> Vec<TcpGroup> {
    let port = zero_core::launch::free_port().expect("a free port");
    let options = TcpOptions {
        timeout: Duration::from_secs(60),
        socket_buffer: Some(1 << 20),
        unix_on_same_host,
    };
    thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| s.spawn(move || TcpGroup::connect(rank, world, "127.0.0.1", port, options)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rendezvous thread").expect("rendezvous"))
            .collect()
    })
}

#[test]
fn tcp_group_reduce_scatter_into_matches_the_reference_over_both_transports() {
    for unix in [false, true] {
        for world in 2..=3 {
            let counts = on_threads(tcp_world(world, unix), |g| exercise_into(g));
            assert_eq!(counts, vec![CHECKS; world], "world {world}, unix sockets {unix}");
            let refused = on_threads(tcp_world(world, unix), |g| refuses_a_wrong_output(g));
            assert_eq!(refused, vec![1; world]);
        }
    }
}
