//! `offload_param` for [`ZeroModule`](super::ZeroModule)s: a cut unit's shard kept in host
//! memory or in a file on NVMe instead of on the model's device ([`ParamStore`]).
//!
//! The unit's flat parameter then holds a placeholder: a tensor of the shard's shape that is
//! one NaN broadcast (no memory of its size, and loud if anything ever reads it as the values),
//! an autodiff leaf whose gradient is the shard's, as before. A gather reads the shard from the
//! store, uploads it and all-gathers it; backward reads it again where it gathers again. A step
//! writes each new shard straight into its store, the placeholder staying; a shard written into
//! the parameter otherwise (a loaded checkpoint) is moved there by
//! [`after_step`](super::after_step). A Burn record of the model carries the stored values (the
//! placeholder's save mapper reads them) and loading one writes them back into the store.
//!
//! The placeholder is told apart by its dtype, f64, which no shard has (parameters are fp32,
//! bf16 or fp16): a copy of it made by any module map (Burn's `no_grad`, fresh leaves for
//! activation checkpointing, `valid()`, `fork`) is still one. A value of another dtype in the
//! parameter is used as it is until the next step moves it into the store.

use super::backend::ShardBackend;
use crate::error::ZeroError;
use burn::module::{Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use std::any::Any;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use zero_core::offload::SwapFile;

/// Where a cut unit's shard is kept between its uses (DeepSpeed's `offload_param`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamPlace {
    /// In host memory.
    Host,
    /// In one file per rank under `path`, but for the first units whose shards fit in
    /// `max_in_cpu` elements, kept in host memory.
    Nvme {
        /// Directory of the parameter files.
        path: PathBuf,
        /// Shard elements kept in host memory before units go to the file.
        max_in_cpu: usize,
    },
}

/// Where one unit's shard is.
enum Place {
    Host(Mutex<Option<TensorData>>),
    File { file: Arc<SwapFile>, byte: u64 },
}

/// The dtype of the placeholder.
const PLACEHOLDER: DType = DType::F64;

/// The dtype of a unit's parameter value (as `Any`: a tensor of the backend the unit was cut
/// for, or of its collective's backend, a `valid()` copy's); `None` for another type.
type DtypeOf = dyn Fn(&dyn Any) -> Option<DType> + Send + Sync;

/// One unit's shard kept off the device: its values, dtype and length.
pub(crate) struct ParamStore {
    place: Place,
    dtype: DType,
    len: usize,
    dtype_of: Box<DtypeOf>,
}

impl std::fmt::Debug for ParamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match &self.place {
            Place::Host(_) => "host".to_string(),
            Place::File { file, byte } => format!("{} at byte {byte}", file.path().display()),
        };
        write!(f, "ParamStore({} {:?} in {place})", self.len, self.dtype)
    }
}

impl ParamStore {
    /// Bytes of the shard.
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Whether the shard is in a file (else in host memory).
    pub(crate) fn in_file(&self) -> bool {
        matches!(self.place, Place::File { .. })
    }

    /// Replaces the stored shard with `data` (converted to the store's dtype).
    pub(crate) fn write(&self, data: TensorData) -> Result<(), ZeroError> {
        if data.num_elements() != self.len {
            return Err(ZeroError::Model(format!(
                "offload_param: a shard of {} elements written where the unit's shard has {}",
                data.num_elements(),
                self.len
            )));
        }
        let data = if data.dtype == self.dtype {
            data
        } else {
            data.convert_dtype(self.dtype)
        };
        match &self.place {
            Place::Host(slot) => *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(data),
            Place::File { file, byte } => file.write_bytes_at(*byte, data.as_bytes())?,
        }
        Ok(())
    }

    /// The stored shard.
    pub(crate) fn read(&self) -> Result<TensorData, ZeroError> {
        match &self.place {
            Place::Host(slot) => {
                slot.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| {
                    ZeroError::Model("offload_param: a unit's shard was read before it was written".into())
                })
            }
            Place::File { file, byte } => {
                let mut bytes = vec![0u8; self.bytes()];
                file.read_bytes_at(*byte, &mut bytes)?;
                Ok(TensorData::from_bytes_vec(bytes, [self.len], self.dtype))
            }
        }
    }

    /// The stored shard as a tensor on `device`.
    pub(crate) fn read_tensor<I: Backend>(&self, device: &I::Device) -> Result<Tensor<I, 1>, ZeroError> {
        Ok(Tensor::from_data(self.read()?, (device, self.dtype)))
    }

    /// Whether `value` (a unit's parameter, as `Any`) is a placeholder, so the store holds the
    /// unit's values: its dtype is the placeholder's (a value of an unknown type can only be a
    /// copy of it too).
    pub(crate) fn stands_for(&self, value: &dyn Any) -> bool {
        (self.dtype_of)(value).is_none_or(|d| d == PLACEHOLDER)
    }

    /// The dtype of the stored shard.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }
}

/// Where a cut puts the shards of the units it offloads: the rank's parameter file, made at
/// the first unit that goes there, and the host memory left under `max_in_cpu`.
pub(super) struct Stash {
    place: ParamPlace,
    rank: usize,
    file: Option<(Arc<SwapFile>, u64)>,
    host_left: usize,
}

impl Stash {
    pub(super) fn new(place: ParamPlace, rank: usize) -> Self {
        let host_left = match &place {
            ParamPlace::Host => usize::MAX,
            ParamPlace::Nvme { max_in_cpu, .. } => *max_in_cpu,
        };
        Stash {
            place,
            rank,
            file: None,
            host_left,
        }
    }

    /// A store for a shard of `len` elements of `dtype` on backend `B`, holding `data`.
    pub(super) fn store<B: ShardBackend>(
        &mut self,
        data: TensorData,
        len: usize,
        dtype: DType,
    ) -> Result<Arc<ParamStore>, ZeroError> {
        if dtype == PLACEHOLDER {
            return Err(ZeroError::Config(
                "zero_optimization.offload_param: f64 parameters cannot be offloaded (train in fp32, bf16 or fp16)"
                    .into(),
            ));
        }
        let place = match &self.place {
            ParamPlace::Nvme { path, .. } if self.host_left < len => {
                if self.file.is_none() {
                    // A file of its own (SwapFile names each uniquely): several cuts in one
                    // process (tests, two models, tensor ranks) never share one.
                    let file = SwapFile::create(path, &format!("zero_params_rank{}", self.rank))
                        .map_err(|e| ZeroError::Config(format!("zero_optimization.offload_param.nvme_path: {e}")))?;
                    self.file = Some((Arc::new(file), 0));
                }
                let (file, next) = self.file.as_mut().unwrap_or_else(|| unreachable!("made above"));
                let byte = *next;
                *next += (len * dtype.size()) as u64;
                Place::File {
                    file: file.clone(),
                    byte,
                }
            }
            _ => {
                self.host_left = self.host_left.saturating_sub(len);
                Place::Host(Mutex::new(None))
            }
        };
        let store = Arc::new(ParamStore {
            place,
            dtype,
            len,
            dtype_of: Box::new(|value: &dyn Any| {
                value
                    .downcast_ref::<Tensor<B, 1>>()
                    .map(Tensor::dtype)
                    .or_else(|| value.downcast_ref::<Tensor<B::Collective, 1>>().map(Tensor::dtype))
            }),
        });
        store.write(data)?;
        Ok(store)
    }
}

/// A new placeholder of `store` on `device`: the parameter (id `id`) a unit whose shard is in
/// `store` holds, with the mappers that put the stored values in a Burn record and a loaded
/// record's values into the store.
pub(super) fn placeholder<B: ShardBackend>(
    id: ParamId,
    store: &Arc<ParamStore>,
    device: &burn::tensor::Device<B::Collective>,
) -> Param<Tensor<B, 1>> {
    let save = store.clone();
    let load = store.clone();
    let save_device = device.clone();
    let load_device = device.clone();
    Param::initialized(id, placeholder_tensor::<B>(store, device))
        .save_mapper(move |t: Tensor<B, 1>| {
            if !save.stands_for(&t) {
                return t;
            }
            match save.read_tensor::<B::Collective>(&save_device) {
                Ok(values) => B::from_collective(values),
                // A record cannot carry an error: one written without the values would lose them.
                Err(e) => panic!("saving a ZeroModule whose shard is offloaded: {e}"),
            }
        })
        .load_mapper(move |t: Tensor<B, 1>| {
            // Values of another length (a record of another cut) stay in the parameter, where
            // the unit's forward and `initialize` refuse them with an error.
            if load.stands_for(&t) || t.dims()[0] != load.len {
                return t;
            }
            match load.write(B::collective_value(t).into_data()) {
                Ok(()) => placeholder_tensor::<B>(&load, &load_device),
                Err(e) => panic!("loading a ZeroModule whose shard is offloaded: {e}"),
            }
        })
}

/// The placeholder tensor itself: one f64 NaN broadcast to the shard's length, a leaf.
fn placeholder_tensor<B: ShardBackend>(
    store: &ParamStore,
    device: &burn::tensor::Device<B::Collective>,
) -> Tensor<B, 1> {
    let one = Tensor::<B::Collective, 1>::full([1], f64::NAN, (device, PLACEHOLDER));
    B::from_collective(one.expand([store.len]))
}

/// The values of the unit parameter `id` when they are in a store (its value `value` is the
/// store's placeholder): what a reader of the model's values reads instead of the placeholder.
pub(crate) fn stored_values(id: ParamId, value: &dyn Any, numel: usize) -> Option<Result<TensorData, ZeroError>> {
    let store = store_of(id)?;
    (store.len == numel && store.stands_for(value)).then(|| store.read())
}

/// The store of the unit whose flat parameter is `id`, if its shard is offloaded.
pub(crate) fn store_of(id: ParamId) -> Option<Arc<ParamStore>> {
    super::module::unit(id)?.sharding.get()?.store.get().cloned()
}

/// By float parameter of `module` (visit order): the store of a unit whose shard is offloaded
/// and whose parameter holds the store's placeholder, where a step writes the new shard
/// directly (the parameter, still that placeholder, then stands for the new values).
pub(crate) fn stores_in_place<B: Backend, M: burn::module::Module<B>>(module: &M) -> Vec<Option<Arc<ParamStore>>> {
    struct Find(Vec<Option<Arc<ParamStore>>>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Find {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let store = store_of(param.id).filter(|store| {
                let value = param.val();
                value.shape().num_elements() == store.len && store.stands_for(&value)
            });
            self.0.push(store);
        }
    }
    let mut find = Find(Vec::new());
    module.visit(&mut find);
    find.0
}
