//! `ZeroModule`: a Burn module whose float parameters live as this rank's shard of one flat
//! vector (ZeRO stage 3), itself a Burn `Module` that can be a field of any model. Its whole
//! module is reached for one forward through [`ZeroModule::unshard`]; under autodiff the gather
//! is the differentiable op of [`gather`](super::gather), so `loss.backward()` leaves the
//! shard's gradient (averaged over the ranks) where Burn's optimizers and `GradientsParams` look
//! for it.

use super::gather::{gather, UnitComm};
use crate::error::ZeroError;
use crate::params::read_values;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Shape, Tensor, TensorData};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

/// The backends a [`ZeroModule`] runs on: how a unit's shard becomes its whole flat parameters.
/// Autodiff backends gather with the differentiable op; the others (a model's `valid()` copy)
/// gather plainly.
pub trait ShardBackend: Backend {
    /// The backend whose tensors the collectives move (the innermost one).
    type Collective: Backend;

    /// Every rank's `shard` in rank order; `after` is the tensor the unit's forward starts from.
    fn gather_shard<const D: usize>(
        shard: Tensor<Self, 1>,
        after: Option<&Tensor<Self, D>>,
        comm: &ShardComm,
    ) -> Result<Tensor<Self, 1>, ZeroError>;
}

impl<I: ShardBackend<Collective = I>, C: CheckpointStrategy> ShardBackend for Autodiff<I, C> {
    type Collective = I;

    fn gather_shard<const D: usize>(
        shard: Tensor<Self, 1>,
        after: Option<&Tensor<Self, D>>,
        comm: &ShardComm,
    ) -> Result<Tensor<Self, 1>, ZeroError> {
        gather(shard, after, comm.get::<I>()?)
    }
}

/// A plain all-gather, for backends without autodiff.
fn gather_plain<B: Backend>(shard: Tensor<B, 1>, comm: &ShardComm) -> Result<Tensor<B, 1>, ZeroError> {
    comm.get::<B>()?.all_gather(shard)
}

impl ShardBackend for Flex {
    type Collective = Flex;

    fn gather_shard<const D: usize>(
        shard: Tensor<Self, 1>,
        _after: Option<&Tensor<Self, D>>,
        comm: &ShardComm,
    ) -> Result<Tensor<Self, 1>, ZeroError> {
        gather_plain(shard, comm)
    }
}

#[cfg(feature = "cuda")]
impl<F, I, BT> ShardBackend for burn_cubecl::CubeBackend<burn_cubecl::cubecl::cuda::CudaRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    type Collective = Self;

    fn gather_shard<const D: usize>(
        shard: Tensor<Self, 1>,
        _after: Option<&Tensor<Self, D>>,
        comm: &ShardComm,
    ) -> Result<Tensor<Self, 1>, ZeroError> {
        gather_plain(shard, comm)
    }
}

/// The ranks a [`ZeroModule`] is sharded over, whatever the backend of the module's copy at
/// hand (a training model and its `valid()` copy share it): a [`UnitComm`] of the innermost
/// backend.
#[derive(Clone)]
pub struct ShardComm(Arc<dyn Any + Send + Sync>);

impl ShardComm {
    /// The ranks of `comm`.
    pub fn new<I: Backend>(comm: UnitComm<I>) -> Self {
        ShardComm(Arc::new(comm))
    }

    fn get<I: Backend>(&self) -> Result<&UnitComm<I>, ZeroError> {
        self.0.downcast_ref::<UnitComm<I>>().ok_or_else(|| {
            ZeroError::Config(format!(
                "a ZeroModule sharded for another backend was run on {}",
                std::any::type_name::<I>()
            ))
        })
    }
}

impl std::fmt::Debug for ShardComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShardComm")
    }
}

/// Elements a unit's flat vector is padded to a multiple of, per rank: its shards are cut as the
/// optimizer's layout cuts a sharded group of that alignment, so that a rank's shard is the slice
/// the optimizer owns.
pub const UNIT_ALIGNMENT: usize = 16;

/// The elements of every unit's flat parameters (padding excluded), by the id of its shard
/// parameter: what an optimizer needs to lay the shard out and that the shard's own shape (this
/// rank's slice) does not say. Ids are unique in the process; entries are a few bytes.
fn units() -> &'static std::sync::Mutex<std::collections::HashMap<burn::module::ParamId, usize>> {
    static UNITS: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<burn::module::ParamId, usize>>> =
        std::sync::OnceLock::new();
    UNITS.get_or_init(Default::default)
}

/// The elements of the unit whose shard parameter is `id` (padding excluded); `None` for a
/// parameter that is not a [`ZeroModule`]'s shard.
pub fn unit_numel(id: burn::module::ParamId) -> Option<usize> {
    units().lock().unwrap_or_else(|e| e.into_inner()).get(&id).copied()
}

/// This rank's shard length for a unit of `numel` elements over `world` ranks.
pub fn shard_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world * UNIT_ALIGNMENT).max(1) * UNIT_ALIGNMENT
}

/// Where each float parameter of the unit sits in its flat vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitLayout {
    /// Shapes of the float parameters, in visit order.
    pub shapes: Vec<Vec<usize>>,
    /// Elements of each rank's shard (the flat vector zero-padded to a multiple of the ranks).
    pub shard_len: usize,
}

impl UnitLayout {
    /// Elements of the parameters (padding excluded).
    pub fn numel(&self) -> usize {
        self.shapes.iter().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// A module `M` of backend `B` held as this rank's shard of its flat parameters (visit order,
/// zero-padded to a multiple of the ranks, cut in equal contiguous shards). The module itself is
/// kept as a skeleton: its structure and parameter ids, with empty tensors.
#[derive(Module, Debug)]
pub struct ZeroModule<B: Backend, M> {
    /// This rank's shard: the only parameter that holds values (and gets a gradient).
    shard: Param<Tensor<B, 1>>,
    /// `M` with every float parameter an empty tensor.
    skeleton: M,
    #[module(skip)]
    layout: Arc<UnitLayout>,
    #[module(skip)]
    comm: ShardComm,
}

impl<B, M> ZeroModule<B, M>
where
    B: ShardBackend,
    M: Module<B>,
{
    /// Shards `module` (the same on every rank: one seed, or loaded) over `comm`. This rank keeps
    /// its slice of the flat parameters as a parameter that records gradients; the module's own
    /// values are dropped.
    pub fn new(module: M, comm: UnitComm<B::Collective>) -> Result<Self, ZeroError> {
        let mut values = Vec::new();
        read_values::<B, _>(&module, |_, v| values.extend(v));
        let shapes: Vec<Vec<usize>> = crate::params::describe::<B, _>(&module)
            .into_iter()
            .map(|(_, spec)| spec.shape)
            .collect();
        let device = module
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| ZeroError::Config("a ZeroModule needs a module with parameters".into()))?;
        let world = comm.world_size();
        let numel = values.len();
        let shard_len = shard_len(numel, world);
        values.resize(shard_len * world, 0.0);
        let rank = comm.rank();
        let mine = values[rank * shard_len..(rank + 1) * shard_len].to_vec();
        drop(values);
        let shard = Tensor::<B, 1>::from_data(TensorData::new(mine, [shard_len]), &device);
        let skeleton = module.map(&mut Emptied);
        let shard = Param::from_tensor(shard);
        units()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shard.id, numel);
        Ok(ZeroModule {
            shard,
            skeleton,
            layout: Arc::new(UnitLayout { shapes, shard_len }),
            comm: ShardComm::new(comm),
        })
    }

    /// This rank's shard.
    pub fn shard(&self) -> &Param<Tensor<B, 1>> {
        &self.shard
    }

    /// Where the unit's parameters sit in its flat vector.
    pub fn layout(&self) -> &UnitLayout {
        &self.layout
    }

    /// The module with its whole parameters, gathered from every rank's shard, for one forward
    /// that starts from `input` (under autodiff, the input orders the gradient's reduce-scatter
    /// right after the unit's backward).
    pub fn unshard<const D: usize>(&self, input: &Tensor<B, D>) -> Result<M, ZeroError> {
        let whole = B::gather_shard(self.shard.val(), Some(input), &self.comm)?;
        let mut offset = 0;
        let parts: VecDeque<_> = self
            .layout
            .shapes
            .iter()
            .map(|shape| {
                let n = shape.iter().product::<usize>();
                offset += n;
                (whole.clone().narrow(0, offset - n, n), Shape::from(shape.clone()))
            })
            .collect();
        Ok(self.skeleton.clone().map(&mut Filled(parts)))
    }
}

/// Replaces each float parameter by an empty tensor of its rank, keeping its id.
struct Emptied;

impl<B: Backend> ModuleMapper<B> for Emptied {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let device = param.lazy_device();
        Param::initialized(param.id, Tensor::<B, D>::empty([0; D], &device))
    }
}

/// Fills each float parameter, in visit order, with the next flat part in its recorded shape.
struct Filled<B: Backend>(VecDeque<(Tensor<B, 1>, Shape)>);

impl<B: Backend> ModuleMapper<B> for Filled<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        match self.0.pop_front() {
            Some((part, shape)) => Param::initialized(param.id, part.reshape(shape)),
            // The layout is recorded from this module's own parameters: one part per parameter.
            None => unreachable!("a ZeroModule's skeleton has more float parameters than its layout"),
        }
    }
}

/// Whether `module` holds a [`ZeroModule`] anywhere inside it.
pub fn contains_zero_module<B: Backend, M: Module<B>>(module: &M) -> bool {
    struct Find(bool);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Find {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            // The container type Burn's derive names: `Struct:` and the type's name.
            self.0 |= container_type == "Struct:ZeroModule";
        }
    }
    let mut find = Find(false);
    module.visit(&mut find);
    find.0
}

/// The error of an engine that cannot run a model holding [`ZeroModule`]s: their shards differ
/// by rank and their gradients arrive reduced, so an engine that reduces them as replicas would
/// average different ranks' shards together. `Ok` for a model without them.
pub(crate) fn refuse_zero_modules<B: Backend, M: Module<B>>(module: &M, engine: &str) -> Result<(), ZeroError> {
    if contains_zero_module::<B, M>(module) {
        return Err(ZeroError::Config(format!(
            "{engine} does not step ZeroModule shards; train a model holding ZeroModules in a Burn loop with \
             zero_burn::ZeroOptimizer"
        )));
    }
    Ok(())
}
