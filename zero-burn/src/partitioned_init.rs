//! Partitioned construction (DeepSpeed's `zero.Init`): a stage-3 [`ChainEngine`] built part by
//! part, so that no rank ever holds the whole model.
//!
//! [`ChainEngine::new`] takes a model that already exists whole. For a model larger than one
//! rank's memory that is too late. [`ChainEngine::new_partitioned`] takes the ends and a
//! constructor `|index| -> Block` instead. Each part is built, flattened, rounded to the compute
//! dtype, cut to the rank's shard, and dropped (a parameter-less skeleton stays) before the next
//! one is built: a rank holds at most the ends, one full block and its own shards.
//!
//! The result equals `ChainEngine::new` on the whole model, bit for bit, when the parts hold the
//! same values. For random initialization that means building the parts in the order the whole
//! model draws them: the ends first (as `ChainEngine::new` reads them), then the blocks in order.
//! With [`InitValues::RankZero`] only rank 0's values count, as with `ChainEngine::new`: they are
//! broadcast part by part; a module whose parameters are initialized lazily (Burn's
//! initializers) is never materialized on the other ranks.

use crate::chain::ChainModel;
use crate::chain_engine::{ChainEngine, Part};
use crate::core::EngineCore;
use crate::error::ZeroError;
use crate::flat_state::GradFlow;
use crate::half_buffer;
use crate::memory::MemoryTracker;
use crate::params::{describe, skeleton, tensor_to_vec};
use crate::settings::{ComputeDtype, EngineSettings, Stage};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use std::ops::Range;
use std::sync::Arc;
use zero_core::comm::{FlatBuffer, ProcessGroup};
use zero_core::partition::{LayoutBuilder, ParamSpec, PartitionLayout, Placement};

/// Whose values a partitioned construction keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitValues {
    /// Rank 0's, broadcast part by part (random initialization: the ranks' generators may
    /// differ). What [`ChainEngine::new`] does.
    RankZero,
    /// Every rank's own, with no communication: every rank builds the same values (each reads
    /// the same checkpoint file).
    Local,
}

/// A partitioned construction failed: building a part, or setting up the engine.
#[derive(Debug, thiserror::Error)]
pub enum PartitionedInitError<E: std::error::Error + 'static> {
    /// The block constructor failed.
    #[error("building block {block}: {source}")]
    Build {
        /// The block's index.
        block: usize,
        /// The constructor's error.
        source: E,
    },
    /// The engine could not be set up (configuration, model shape, a collective).
    #[error(transparent)]
    Engine(#[from] ZeroError),
}

/// The rank's shard of one parameter: the pieces of its flattened values that the rank owns.
type OwnedPieces = Vec<(Range<usize>, Vec<f32>)>;

impl<B: AutodiffBackend, M: ChainModel<B>> ChainEngine<B, M> {
    /// Builds the engine from the ends and a constructor of each of `num_blocks` blocks, called
    /// once per block, in order (DeepSpeed's `zero.Init`). Under stage 3 a rank never holds more
    /// than the ends, one full block and its own shards; under stages 0-2, which keep the whole
    /// model on every rank anyway, the blocks are built and handed to [`ChainEngine::new`].
    ///
    /// ```ignore
    /// B::seed(&device, 42);
    /// let ends = config.init_ends(&device);
    /// let engine = ChainEngine::<B, Net<B>>::new_partitioned(settings, ends, 48,
    ///     |i| config.init_block(i, &device), InitValues::RankZero, comm)?;
    /// ```
    pub fn new_partitioned(
        settings: EngineSettings,
        ends: M::Ends,
        num_blocks: usize,
        mut build_block: impl FnMut(usize) -> M::Block,
        values: InitValues,
        comm: Arc<dyn ProcessGroup>,
    ) -> Result<Self, ZeroError> {
        let built = Self::try_new_partitioned(
            settings,
            ends,
            num_blocks,
            |b| Ok::<_, std::convert::Infallible>(build_block(b)),
            values,
            comm,
        );
        built.map_err(|e| match e {
            PartitionedInitError::Engine(e) => e,
            PartitionedInitError::Build { source, .. } => match source {},
        })
    }

    /// [`new_partitioned`](Self::new_partitioned) with a fallible block constructor (a block
    /// read from a file): its error is returned with the block's index.
    pub fn try_new_partitioned<E: std::error::Error + 'static>(
        settings: EngineSettings,
        ends: M::Ends,
        num_blocks: usize,
        mut build_block: impl FnMut(usize) -> Result<M::Block, E>,
        values: InitValues,
        comm: Arc<dyn ProcessGroup>,
    ) -> Result<Self, PartitionedInitError<E>> {
        let mut build = |b: usize| build_block(b).map_err(|source| PartitionedInitError::Build { block: b, source });
        if settings.stage != Stage::Zero3 {
            let blocks = (0..num_blocks).map(&mut build).collect::<Result<Vec<_>, _>>()?;
            return Ok(ChainEngine::new(settings, M::from_parts(ends, blocks), comm)?);
        }
        if num_blocks == 0 {
            return Err(ZeroError::Model(
                "stage 3 gathers parameters block by block, but the partitioned construction was given no blocks"
                    .into(),
            )
            .into());
        }
        let mut cutter = ShardCutter {
            settings: &settings,
            comm: comm.as_ref(),
            values,
            specs: Vec::new(),
            part_params: Vec::new(),
            owned: Vec::new(),
        };
        let mut device = lazy_device::<B, _>(&ends);
        let ends = cutter.take_part::<B, _>("ends.".into(), ends)?;
        let mut blocks = Vec::with_capacity(num_blocks);
        for b in 0..num_blocks {
            let block = build(b)?;
            if device.is_none() {
                device = lazy_device::<B, _>(&block);
            }
            blocks.push(cutter.take_part::<B, _>(format!("blocks.{b}."), block)?);
        }
        let device = device.ok_or_else(|| ZeroError::Model("the model has no parameters (no device found)".into()))?;

        let ShardCutter {
            specs,
            part_params,
            mut owned,
            ..
        } = cutter;
        let world = comm.world_size();
        let numels: Vec<usize> = specs.iter().map(ParamSpec::numel).collect();
        let mut builder = LayoutBuilder::new(specs, world, settings.alignment);
        let mut parts: Vec<Part> = part_params
            .into_iter()
            .map(|params| {
                let groups = stage3_groups(&mut builder, &params, &numels, settings.param_persistence_threshold);
                Part {
                    params,
                    groups,
                    gathered_elements: 0,
                }
            })
            .collect();
        let layout = builder.finish();
        crate::chain_engine::count_gathered_elements(&mut parts, &layout);

        let memory = Arc::new(MemoryTracker::default());
        let dtype = settings.precision.dtype;
        let flows = |g: usize| match layout.groups[g].placement {
            Placement::Sharded => GradFlow::ReduceThenAccumulate,
            Placement::Replicated => GradFlow::AccumulateThenReduce,
        };
        // The state copies only the owned ranges out of each full vector; the rest stays zero.
        // Allocated zeroed, those pages are mostly never touched, and each vector lives only
        // until its group is copied.
        let full_values = |p: usize| {
            let mut full = vec![0.0f32; numels[p]];
            for (range, piece) in std::mem::take(&mut owned[p]) {
                full[range].copy_from_slice(&piece);
            }
            full
        };
        let core = EngineCore::new(layout.clone(), comm, settings, flows, full_values, memory)?;
        if dtype == ComputeDtype::F32 {
            core.count_masters_as_parameters();
        }
        Ok(ChainEngine::from_state(ends, blocks, parts, core, device))
    }
}

/// Stage 3's groups of one part: its large parameters sharded, those under the persistence
/// threshold replicated (the rule of `ChainEngine::new`).
fn stage3_groups(builder: &mut LayoutBuilder, params: &[usize], numels: &[usize], threshold: usize) -> Vec<usize> {
    let (small, large): (Vec<usize>, Vec<usize>) = params.iter().partition(|&&p| numels[p] < threshold);
    let mut groups = Vec::new();
    groups.extend(builder.group(large, Placement::Sharded));
    groups.extend(builder.group(small, Placement::Replicated));
    groups
}

/// The device of a module's first float parameter, without materializing a lazy one
/// (`Module::devices` would, drawing its random values).
fn lazy_device<B: AutodiffBackend, P: Module<B>>(module: &P) -> Option<B::Device> {
    struct First<B: AutodiffBackend>(Option<B::Device>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for First<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.0.is_none() {
                self.0 = Some(param.lazy_device());
            }
        }
    }
    let mut first = First::<B>(None);
    module.visit(&mut first);
    first.0
}

/// The module's float parameter values (flattened, f32, in visit order) and its skeleton. Each
/// parameter's tensor is released as its values are taken, so that a part is never held twice.
fn take_values<B: AutodiffBackend, P: Module<B>>(module: P) -> (P, Vec<Vec<f32>>) {
    struct Take {
        values: Vec<Vec<f32>>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Take {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape();
            let device = param.lazy_device();
            let (id, tensor, _) = param.consume();
            self.values.push(tensor_to_vec(tensor));
            let init_shape = shape.clone();
            // As `params::skeleton`: a placeholder that never allocates unless read directly.
            Param::uninitialized(
                id,
                move |device, _| Tensor::zeros(init_shape.clone(), device),
                device,
                false,
                shape,
            )
        }
    }
    let mut take = Take { values: Vec::new() };
    let skeleton = module.map(&mut take);
    (skeleton, take.values)
}

/// Walks the parts in order, keeping only the rank's owned pieces of each.
struct ShardCutter<'a> {
    settings: &'a EngineSettings,
    comm: &'a dyn ProcessGroup,
    values: InitValues,
    /// Every parameter met so far, named `ends.…` / `blocks.{b}.…`.
    specs: Vec<ParamSpec>,
    /// Global parameter indices of each part.
    part_params: Vec<Vec<usize>>,
    /// The owned pieces of every parameter.
    owned: Vec<OwnedPieces>,
}

impl ShardCutter<'_> {
    /// Takes one part's values (rank 0's broadcast, or the rank's own), keeps the owned pieces
    /// and returns the part's skeleton.
    fn take_part<B: AutodiffBackend, P: Module<B>>(&mut self, prefix: String, part: P) -> Result<P, ZeroError> {
        let listed = describe::<B, _>(&part);
        let local_specs: Vec<ParamSpec> = listed.into_iter().map(|(_, s)| s).collect();
        let world = self.comm.world_size();
        let rank = self.comm.rank();
        let broadcast = self.values == InitValues::RankZero && world > 1;
        let (part, mut values) = if broadcast && rank != 0 {
            // Never materialize (or draw) values that rank 0's broadcast replaces.
            let zeros = local_specs.iter().map(|s| vec![0.0; s.numel()]).collect();
            (skeleton::<B, _>(part), zeros)
        } else {
            take_values::<B, _>(part)
        };
        if broadcast {
            let mut flat = Vec::with_capacity(values.iter().map(Vec::len).sum());
            for v in &values {
                flat.extend_from_slice(v);
            }
            let mut buf = FlatBuffer::F32(flat);
            self.comm.broadcast(&mut buf, 0)?;
            let flat = buf.into_f32();
            let mut at = 0;
            for v in &mut values {
                let n = v.len();
                v.copy_from_slice(&flat[at..at + n]);
                at += n;
            }
        }
        for v in &mut values {
            // As `ChainEngine::new`: the masters are made from the values rounded to the
            // compute dtype, so that the model sees exactly its masters rounded.
            half_buffer::round_to(self.settings.precision.dtype, v);
        }

        // The part's own layout cuts it exactly as the whole layout will: a group's offsets and
        // padding depend only on its own parameters.
        let mut local = LayoutBuilder::new(local_specs.clone(), world, self.settings.alignment);
        let local_params: Vec<usize> = (0..local_specs.len()).collect();
        let numels: Vec<usize> = local_specs.iter().map(ParamSpec::numel).collect();
        let groups = stage3_groups(
            &mut local,
            &local_params,
            &numels,
            self.settings.param_persistence_threshold,
        );
        let local: PartitionLayout = local.finish();
        let start = self.specs.len();
        let mut owned: Vec<OwnedPieces> = vec![Vec::new(); local_specs.len()];
        for g in groups {
            for seg in local.segments(g, rank) {
                let piece = values[seg.param][seg.in_param.clone()].to_vec();
                owned[seg.param].push((seg.in_param, piece));
            }
        }
        drop(values);
        self.owned.extend(owned);
        self.specs.extend(local_specs.into_iter().map(|s| ParamSpec {
            name: format!("{prefix}{}", s.name),
            ..s
        }));
        self.part_params.push((start..self.specs.len()).collect());
        Ok(part)
    }
}
