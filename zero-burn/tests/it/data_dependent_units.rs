//! Units whose use depends on the data: a mixture of experts routes each row to one expert, so
//! that on some rank an expert gets no rows, and a side unit whose output one rank computes and
//! does not use. Every unit's gradient must still be reduce-scattered on every rank (with a
//! zero gradient where the unit did not reach the loss), in the same order, so that the result
//! is the one process's on the whole batch. Reference: the same layers trained by Burn's own SGD
//! on one process over the global batch (no ZeroModule, no collective).
//!
//! Two ways of writing the model: every expert reached every micro-batch with the rows routed
//! to it, its output left out of the loss when it has none (`Empty::Dropped`), or added as a
//! sum over no rows (`Empty::Summed`, the expert's backward runs on empty tensors).

use crate::common;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use std::sync::Arc;
use zero_burn::params::write_values;
use zero_burn::sharded::ZeroModule;
use zero_burn::HostStaged;
use zero_core::comm::{ProcessGroup, TcpGroup};
use zero_core::config::DeepSpeedConfig;

const ROWS: usize = 8;
const IN: usize = 4;
const HIDDEN: usize = 6;
const OUT: usize = 3;
const STEPS: usize = 5;
const LR: f64 = 0.2;

/// Which expert each of the global batch's rows goes to at `step`.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Rank 0's rows (the first half) to expert 0, rank 1's to expert 1: each rank's
    /// reduce-scatters of the two experts would pair the one with the other.
    Swap,
    /// By the data: some steps give an expert no rows on one rank, one on both.
    ByData,
    /// Alternate rows: every expert gets rows on every rank (nothing depends on the data).
    Alternate,
}

impl Routing {
    fn route(self, row: usize, step: usize) -> usize {
        match self {
            Routing::Swap => usize::from(row >= ROWS / 2),
            // Three rows in a row to expert 1, moving with the step: at steps 0, 3 and 4 one
            // rank routes no row there; at step 2 no rank does.
            Routing::ByData => usize::from(step != 2 && (row + step) % 8 < 3),
            Routing::Alternate => row % 2,
        }
    }
}

/// What a forward does with an expert that got no rows on this rank.
#[derive(Clone, Copy, Debug)]
enum Empty {
    /// Reached (gathered) with no rows, its output not part of the loss.
    Dropped,
    /// Reached with no rows, its output summed into the loss (an empty sum).
    Summed,
}

/// The layers, values from a fixed formula: a trunk, two experts and, with `side`, a side unit.
fn layers<B: Backend>(side: bool, device: &B::Device) -> Vec<Linear<B>> {
    let shapes = [(IN, HIDDEN), (HIDDEN, OUT), (HIDDEN, OUT), (HIDDEN, OUT)];
    shapes[..if side { 4 } else { 3 }]
        .iter()
        .enumerate()
        .map(|(u, &(i, o))| {
            write_values(LinearConfig::new(i, o).init(device), device, true, |p| {
                let n = if p == 0 { i * o } else { o };
                (0..n)
                    .map(|k| 0.5 * ((k * 7 + u * 131 + p * 17) as f32 * 0.37).sin())
                    .collect()
            })
        })
        .collect()
}

fn data<B: Backend>(rows: std::ops::Range<usize>, cols: usize, salt: usize, device: &B::Device) -> Tensor<B, 2> {
    let n = rows.len();
    let values: Vec<f32> = rows
        .flat_map(|r| (0..cols).map(move |c| ((r * 11 + c * 3 + salt) as f32 * 0.43).cos()))
        .collect();
    Tensor::from_data(TensorData::new(values, [n, cols]), device)
}

/// The loss of rows `rows` (global indices) through `layer(u)`, the layer `u` gathered for an
/// input (0 the trunk, 1 and 2 the experts, 3 the side unit): the sum over the rows of each
/// row's squared error through its expert, plus, for the rows of the global batch's first half,
/// the side unit's squared output; divided by `per`. `side` says whether the side unit is
/// computed at all.
#[allow(clippy::too_many_arguments)]
fn loss_of<B: Backend>(
    layer: &dyn Fn(usize, &Tensor<B, 2>) -> Linear<B>,
    rows: std::ops::Range<usize>,
    step: usize,
    routing: Routing,
    empty: Empty,
    side: bool,
    per: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let x = data::<B>(rows.clone(), IN, step, device);
    let y = data::<B>(rows.clone(), OUT, 50 + step, device);
    let h = relu(layer(0, &x).forward(x));
    let mut loss: Option<Tensor<B, 1>> = None;
    let add = |loss: &mut Option<Tensor<B, 1>>, t: Tensor<B, 1>| {
        *loss = Some(match loss.take() {
            Some(l) => l + t,
            None => t,
        })
    };
    for expert in 0..2 {
        let mine: Vec<i64> = rows
            .clone()
            .enumerate()
            .filter(|&(_, r)| routing.route(r, step) == expert)
            .map(|(i, _)| i as i64)
            .collect();
        let n = mine.len();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(mine, [n]), device);
        let xe = h.clone().select(0, index.clone());
        let ye = y.clone().select(0, index);
        let out = layer(1 + expert, &xe).forward(xe);
        if n == 0 && matches!(empty, Empty::Dropped) {
            continue;
        }
        add(&mut loss, (out - ye).powf_scalar(2.0).sum());
    }
    if side {
        // Computed for every row of this rank; only the global first half's rows count.
        let out = layer(3, &h).forward(h.clone());
        let first: Vec<i64> = rows
            .clone()
            .enumerate()
            .filter(|&(_, r)| r < ROWS / 2)
            .map(|(i, _)| i as i64)
            .collect();
        if !first.is_empty() {
            let n = first.len();
            let index = Tensor::<B, 1, Int>::from_data(TensorData::new(first, [n]), device);
            add(&mut loss, out.select(0, index).powf_scalar(2.0).sum().mul_scalar(0.1));
        }
    }
    loss.expect("some rows").div_scalar(per as f32)
}

/// The model as a user writes it: every layer a `ZeroModule`.
#[derive(Module, Debug)]
struct Moe<B: Backend> {
    units: Vec<ZeroModule<B, Linear<B>>>,
}

/// How a run is set up.
#[derive(Clone, Copy, Debug)]
struct Case {
    stage: u8,
    routing: Routing,
    empty: Empty,
    side: bool,
    prefetch: bool,
}

fn config(case: Case, world: usize) -> DeepSpeedConfig {
    let prefetch = if case.prefetch {
        r#", "overlap_comm": true, "stage3_prefetch_bucket_size": 40"#
    } else {
        ""
    };
    let text = format!(
        r#"{{"train_batch_size": {ROWS}, "train_micro_batch_size_per_gpu": {},
        "gradient_clipping": 0, "optimizer": {{"type": "SGD", "params": {{"lr": {LR}}}}},
        "zero_optimization": {{"stage": {}, "stage3_param_persistence_threshold": 0{prefetch}}}}}"#,
        ROWS / world,
        case.stage,
    );
    DeepSpeedConfig::from_str(&text, "moe.json").expect("config").config
}

/// Every layer's values (weight, then bias) after the run.
fn values<B: Backend>(layers: &[Linear<B>]) -> Vec<Vec<f32>> {
    layers
        .iter()
        .map(|l| {
            let mut v = zero_burn::params::tensor_to_vec(l.weight.val().flatten::<1>(0, 1));
            if let Some(b) = &l.bias {
                v.extend(zero_burn::params::tensor_to_vec(b.val()));
            }
            v
        })
        .collect()
}

/// One process, the whole batch, Burn's SGD on the plain layers.
fn one_process(case: Case) -> Vec<Vec<f32>> {
    type AB = Autodiff<Flex>;
    let device = Default::default();
    let mut model = layers::<AB>(case.side, &device);
    let mut optim = SgdConfig::new().init();
    for step in 0..STEPS {
        let layer = |u: usize, _: &Tensor<AB, 2>| model[u].clone();
        let loss = loss_of::<AB>(
            &layer,
            0..ROWS,
            step,
            case.routing,
            case.empty,
            case.side,
            ROWS,
            &device,
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    values(&model.valid())
}

/// Two rank threads, each with its half of every step's rows, through `initialize`: each
/// rank's layers after the run, or the first error a forward or step returned.
fn two_ranks<C: CheckpointStrategy>(case: Case) -> Vec<Result<Vec<Vec<f32>>, String>> {
    common::on_ranks(2, |rank, group| train_rank::<C>(case, rank, group))
}

/// One rank of a run over `group`: its half of every step's rows.
fn train_rank<C: CheckpointStrategy>(
    case: Case,
    rank: usize,
    group: Arc<dyn ProcessGroup>,
) -> Result<Vec<Vec<f32>>, String> {
    type Inner = Flex;
    let world = group.world_size();
    let device = Default::default();
    let collective = Arc::new(HostStaged::new(group.clone()));
    let whole = Moe::<Autodiff<Inner, C>> {
        units: layers::<Autodiff<Inner, C>>(case.side, &device)
            .into_iter()
            .map(ZeroModule::new)
            .collect(),
    };
    let (mut model, mut optim) = zero_burn::initialize_on(
        &config(case, world),
        whole,
        group,
        collective,
        &zero_burn::InitOptions::default(),
    )
    .map_err(|e| e.to_string())?;
    let per = ROWS / world;
    let mine = rank * per..(rank + 1) * per;
    for step in 0..STEPS {
        let first_error = std::cell::RefCell::new(None);
        let loss = {
            let layer = |u: usize, input: &Tensor<Autodiff<Inner, C>, 2>| match model.units[u].unshard(input) {
                Ok(m) => m,
                // The run ends with this error after the forward; the layer stands in.
                Err(e) => {
                    first_error.borrow_mut().get_or_insert(e.to_string());
                    layers(case.side, &device).swap_remove(u)
                }
            };
            loss_of(
                &layer,
                mine.clone(),
                step,
                case.routing,
                case.empty,
                case.side,
                per,
                &device,
            )
        };
        if let Some(e) = first_error.into_inner() {
            return Err(e);
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.try_step(LR, model, grads).map_err(|e| e.to_string())?;
    }
    let gathered: Vec<Linear<Inner>> = model
        .valid()
        .units
        .iter()
        .map(|u| u.gathered().map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    Ok(values(&gathered))
}

fn check<C: CheckpointStrategy>(case: Case) {
    let want = one_process(case);
    let start = layers::<Flex>(case.side, &Default::default());
    let moved = zero_test_support::max_abs_diff("the reference's move", &values(&start), &want);
    assert!(moved > 1e-2, "{case:?}: the reference trained ({moved:e})");
    for (rank, got) in two_ranks::<C>(case).iter().enumerate() {
        let got = got.as_ref().unwrap_or_else(|e| panic!("{case:?}, rank {rank}: {e}"));
        let err = zero_test_support::max_abs_diff(&format!("{case:?}, rank {rank}"), got, &want);
        assert!(err < 1e-6, "{case:?}, rank {rank}: {err:e} off one process");
    }
}

fn case(stage: u8, routing: Routing, empty: Empty) -> Case {
    Case {
        stage,
        routing,
        empty,
        side: false,
        prefetch: false,
    }
}

#[test]
fn experts_every_rank_uses() {
    for stage in [2, 3] {
        check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(case(
            stage,
            Routing::Alternate,
            Empty::Dropped,
        ));
    }
    check::<BalancedCheckpointing>(case(3, Routing::Alternate, Empty::Dropped));
}

#[test]
fn swapped_experts_at_stage_2() {
    check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(case(2, Routing::Swap, Empty::Dropped));
}

#[test]
fn swapped_experts_at_stage_3() {
    check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(case(3, Routing::Swap, Empty::Dropped));
}

#[test]
fn experts_routed_by_the_data_at_stages_2_and_3() {
    for stage in [2, 3] {
        for empty in [Empty::Dropped, Empty::Summed] {
            check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(case(
                stage,
                Routing::ByData,
                empty,
            ));
        }
    }
}

#[test]
fn experts_routed_by_the_data_prefetched() {
    check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(Case {
        prefetch: true,
        ..case(3, Routing::ByData, Empty::Dropped)
    });
}

/// Under a checkpointing strategy a unit is gathered again in backward where the loss reached
/// it: the pattern that trains there keeps every expert's output in every rank's loss.
#[test]
fn experts_routed_by_the_data_checkpointed_with_empty_sums() {
    for prefetch in [false, true] {
        check::<BalancedCheckpointing>(Case {
            prefetch,
            ..case(3, Routing::ByData, Empty::Summed)
        });
    }
}

#[test]
fn a_unit_one_rank_computes_and_does_not_use() {
    for stage in [2, 3] {
        check::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(Case {
            side: true,
            ..case(stage, Routing::ByData, Empty::Summed)
        });
    }
}

/// Where the checkpointed backward's gathers differ between the ranks (an expert's output left
/// out of one rank's loss), both ranks end with an error naming both units and what to do,
/// at once: not a wait, not a wrong step.
#[test]
fn a_unit_left_out_of_one_ranks_loss_under_checkpointing_is_a_named_error() {
    let started = std::time::Instant::now();
    let case = case(3, Routing::Swap, Empty::Dropped);
    for (rank, run) in two_ranks::<BalancedCheckpointing>(case).into_iter().enumerate() {
        let e = run.expect_err("the ranks gather different units in backward");
        assert!(
            e.contains("unit 1") && e.contains("unit 2") && e.contains("rank 0") && e.contains("rank 1"),
            "rank {rank}: {e}"
        );
        assert!(
            e.contains("BalancedCheckpointing") && e.contains("empty sum"),
            "rank {rank}: {e}"
        );
    }
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
}

/// The cases a launched rank runs, by name.
const LAUNCHED: [(&str, u8, Routing); 3] = [
    ("swap-2", 2, Routing::Swap),
    ("swap-3", 3, Routing::Swap),
    ("data-3", 3, Routing::ByData),
];

/// One launched rank (run by `launched_processes_match_one_process`, with the torchrun
/// variables): trains its case over TCP and prints its layers as one `RESULT` line.
#[test]
#[ignore = "a rank process of launched_processes_match_one_process"]
fn launched_rank() {
    let name = std::env::var("ZERO_TEST_CASE").expect("ZERO_TEST_CASE");
    if name == "gone" {
        return gone_after_forward();
    }
    let &(_, stage, routing) = LAUNCHED.iter().find(|c| c.0 == name).expect("a known case");
    let group: Arc<dyn ProcessGroup> = Arc::new(TcpGroup::from_env(None).expect("rendezvous"));
    let rank = group.rank();
    let got = train_rank::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>(
        case(stage, routing, Empty::Dropped),
        rank,
        group,
    )
    .expect("train");
    println!("RESULT {}", serde_json::to_string(&got).expect("json"));
}

/// Starts two ranks of `launched_rank` in `mode` (this test binary, once per rank, with the
/// torchrun variables); a watchdog ends a rank still running after `watchdog_secs`. Each
/// rank's (exit success, stdout + stderr).
fn launch(mode: &str, watchdog_secs: u64) -> Vec<(bool, String)> {
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe().expect("test binary");
    let port = zero_core::launch::free_port().expect("a free port").to_string();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "data_dependent_units::launched_rank",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("ZERO_TEST_CASE", mode)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZERO_COMM_TIMEOUT_SECS", "120")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(watchdog_secs);
    children
        .into_iter()
        .map(|mut child| {
            while child.try_wait().expect("try_wait").is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let out = child.wait_with_output().expect("output");
            let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        })
        .collect()
}

/// The text after `RESULT ` in a rank's output (libtest may print the test's name on the same
/// line first).
fn result(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
}

/// The same runs with ranks as processes over TCP: each rank's layers equal one process's.
/// The collective timeout (120 s) is beyond the watchdog (60 s): a hang fails, it is not
/// waited out.
#[test]
fn launched_processes_match_one_process() {
    for &(name, stage, routing) in &LAUNCHED {
        let want = one_process(case(stage, routing, Empty::Dropped));
        for (rank, (ok, text)) in launch(name, 60).iter().enumerate() {
            assert!(ok, "{name}, rank {rank}:\n{text}");
            let line = result(text).unwrap_or_else(|| panic!("{name}, rank {rank}: no result:\n{text}"));
            let got: Vec<Vec<f32>> = serde_json::from_str(line).expect("a rank's layers");
            let err = zero_test_support::max_abs_diff(&format!("{name}, rank {rank}"), &got, &want);
            assert!(err < 1e-6, "{name}, rank {rank}: {err:e} off one process");
        }
    }
}

/// A rank of `a_peer_gone_during_backward_is_the_steps_error`: rank 1 exits after its first
/// forward; rank 0 prints what its backward and step made of it.
fn gone_after_forward() {
    type AB = Autodiff<Flex>;
    let group: Arc<dyn ProcessGroup> = Arc::new(TcpGroup::from_env(None).expect("rendezvous"));
    let rank = group.rank();
    let case = case(3, Routing::Alternate, Empty::Dropped);
    let device = Default::default();
    let collective = Arc::new(HostStaged::new(group.clone()));
    let whole = Moe::<AB> {
        units: layers::<AB>(false, &device).into_iter().map(ZeroModule::new).collect(),
    };
    let (model, mut optim) = zero_burn::initialize_on(
        &config(case, 2),
        whole,
        group,
        collective,
        &zero_burn::InitOptions::default(),
    )
    .expect("initialize");
    let layer = |u: usize, input: &Tensor<AB, 2>| model.units[u].unshard(input).expect("gather");
    let loss = loss_of(
        &layer,
        rank * 4..rank * 4 + 4,
        0,
        case.routing,
        case.empty,
        false,
        4,
        &device,
    );
    if rank == 1 {
        std::process::exit(0);
    }
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    match optim.try_step(LR, model, grads) {
        Ok(_) => println!("RESULT \"stepped\""),
        Err(e) => println!("RESULT {}", serde_json::to_string(&e.to_string()).expect("json")),
    }
}

/// A peer that is gone when this rank's backward reduce-scatters (its process exited after
/// its forward): the rank's step returns the group's error naming the peer, with no panic in
/// backward and no wait for the timeout.
#[test]
fn a_peer_gone_during_backward_is_the_steps_error() {
    let outs = launch("gone", 30);
    let (ok, text) = &outs[0];
    assert!(ok, "rank 0 ends cleanly:\n{text}");
    assert!(!text.contains("panicked"), "{text}");
    let e: String = serde_json::from_str(result(text).expect("a result")).expect("a message");
    assert!(e.contains("rank 1") && e.contains("gone"), "{e}");
}
