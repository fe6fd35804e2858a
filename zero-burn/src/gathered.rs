//! Explicit access to partitioned parameters (DeepSpeed's `GatheredParameters`).
//!
//! Under stage 3 no rank holds a whole parameter; to read one (or a block), or to change it
//! outside the optimizer (a custom initialization, weight surgery, loading a few tensors), every
//! rank gathers it with [`ChainEngine::gather_parameters`] (or [`ChainEngine::gather_block`]).
//! The gathered values are the fp32 masters. With `modifier_rank = Some(r)`, the values rank `r`
//! holds when the gather ends ([`GatheredParameters::finish`], or the drop) are broadcast and
//! written into every rank's shard: the fp32 masters and the 16-bit copy the model gathers,
//! and, at stages 0-2, the model's replica. Without a modifier rank the gather is read-only.
//!
//! Every rank must make the same calls (they are collectives), between steps, not between a
//! forward and its backward.

use crate::chain::ChainModel;
use crate::chain_engine::ChainEngine;
use crate::error::ZeroError;
use crate::params::{read_values, write_values};
use crate::settings::Stage;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use half::{bf16, f16};
use std::collections::BTreeSet;
use zero_core::comm::FlatBuffer;
use zero_core::partition::Placement;

/// Parameters gathered whole on every rank (see the module documentation).
///
/// ```ignore
/// let mut gathered = engine.gather_parameters(&["blocks.3.mlp.c_fc.weight"], Some(0))?;
/// if rank == 0 {
///     gathered.values_mut("blocks.3.mlp.c_fc.weight")?.iter_mut().for_each(|w| *w *= 0.5);
/// }
/// gathered.finish()?; // every rank's shard now holds rank 0's values
/// ```
pub struct GatheredParameters<'a, B: AutodiffBackend, M: ChainModel<B>> {
    engine: &'a mut ChainEngine<B, M>,
    /// Global parameter indices, in the order asked for.
    params: Vec<usize>,
    /// Their full values, in the same order.
    values: Vec<Vec<f32>>,
    modifier_rank: Option<usize>,
    /// The part (0: the ends, `b + 1`: block `b`) when a whole part was gathered.
    part: Option<usize>,
    /// Bytes counted as gathered in the engine's memory report.
    bytes: usize,
    finished: bool,
}

impl<B: AutodiffBackend, M: ChainModel<B>> ChainEngine<B, M> {
    /// Gathers the named parameters (their names in [`ChainEngine::layout`]: `ends.…`,
    /// `blocks.{b}.…`) on every rank. With `modifier_rank = Some(r)`, rank `r`'s values are
    /// written back into every rank's shard when the gather ends.
    pub fn gather_parameters(
        &mut self,
        names: &[&str],
        modifier_rank: Option<usize>,
    ) -> Result<GatheredParameters<'_, B, M>, ZeroError> {
        let layout = &self.core.state.layout;
        let params = names
            .iter()
            .map(|name| {
                layout.params.iter().position(|p| p.name == *name).ok_or_else(|| {
                    ZeroError::Usage(format!(
                        "gather_parameters: no parameter named `{name}` (names look like `{}`)",
                        layout.params.first().map_or("ends.…", |p| p.name.as_str())
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        GatheredParameters::new(self, params, modifier_rank, None)
    }

    /// Gathers every parameter of block `block` on every rank (see
    /// [`gather_parameters`](Self::gather_parameters)); [`GatheredParameters::block`] gives it
    /// as a module.
    pub fn gather_block(
        &mut self,
        block: usize,
        modifier_rank: Option<usize>,
    ) -> Result<GatheredParameters<'_, B, M>, ZeroError> {
        let Some(part) = self.parts.get(block + 1) else {
            return Err(ZeroError::Usage(format!(
                "gather_block: block {block} does not exist (the model has {} blocks)",
                self.blocks.len()
            )));
        };
        let params = part.params.clone();
        GatheredParameters::new(self, params, modifier_rank, Some(block + 1))
    }
}

impl<'a, B: AutodiffBackend, M: ChainModel<B>> GatheredParameters<'a, B, M> {
    fn new(
        engine: &'a mut ChainEngine<B, M>,
        params: Vec<usize>,
        modifier_rank: Option<usize>,
        part: Option<usize>,
    ) -> Result<Self, ZeroError> {
        let world = engine.core.comm.world_size();
        if let Some(r) = modifier_rank {
            if r >= world {
                return Err(ZeroError::Usage(format!(
                    "gather_parameters: modifier rank {r} is not a rank of this world of {world}"
                )));
            }
        }
        // The last step's update may still run in the background: the masters are read below.
        engine.settle_state()?;
        if !engine.prefetched.is_empty() {
            return Err(ZeroError::Usage(
                "gather_parameters: called between a forward and its backward; gather between steps".into(),
            ));
        }
        let core = &engine.core;
        let layout = &core.state.layout;
        let places = &core.places;
        let groups: BTreeSet<usize> = params.iter().map(|&p| places[p].group).collect();
        let mut values: Vec<Vec<f32>> = params.iter().map(|&p| vec![0.0; layout.params[p].numel()]).collect();
        let mut bytes = 0;
        for g in groups {
            let state = &core.state.groups[g];
            if state.master.len() != layout.owned_len(g) {
                return Err(ZeroError::Usage(
                    "gather_parameters: the fp32 masters are swapped to NVMe (offload_optimizer: nvme); \
                     gathering them is not supported"
                        .into(),
                ));
            }
            let full = match layout.groups[g].placement {
                Placement::Sharded if world > 1 => {
                    core.comm.all_gather(FlatBuffer::F32(state.master.clone()))?.into_f32()
                }
                _ => state.master.clone(),
            };
            bytes += full.len() * 4;
            core.memory.add_gathered(full.len() * 4);
            for (i, &p) in params.iter().enumerate() {
                if places[p].group == g {
                    let at = places[p].offset;
                    let n = values[i].len();
                    values[i].copy_from_slice(&full[at..at + n]);
                }
            }
        }
        Ok(GatheredParameters {
            engine,
            params,
            values,
            modifier_rank,
            part,
            bytes,
            finished: false,
        })
    }

    /// The gathered parameters' names, in the order asked for.
    pub fn names(&self) -> Vec<&str> {
        let layout = &self.engine.core.state.layout;
        self.params.iter().map(|&p| layout.params[p].name.as_str()).collect()
    }

    /// The shape of a gathered parameter.
    pub fn shape(&self, name: &str) -> Result<&[usize], ZeroError> {
        let i = self.index(name)?;
        Ok(&self.engine.core.state.layout.params[self.params[i]].shape)
    }

    /// A gathered parameter's values (fp32 masters, flattened row-major).
    pub fn values(&self, name: &str) -> Result<&[f32], ZeroError> {
        let i = self.index(name)?;
        Ok(&self.values[i])
    }

    /// A gathered parameter's values, to change. Only a gather with a modifier rank can be
    /// changed; only the modifier rank's changes are kept.
    pub fn values_mut(&mut self, name: &str) -> Result<&mut [f32], ZeroError> {
        self.check_writable(name)?;
        let i = self.index(name)?;
        Ok(&mut self.values[i])
    }

    /// A gathered parameter as an fp32 tensor on the engine's device (recording no gradient).
    pub fn tensor<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, ZeroError> {
        let i = self.index(name)?;
        let shape = self.shape(name)?.to_vec();
        if shape.len() != D {
            return Err(ZeroError::Usage(format!(
                "parameter `{name}` has {} dimensions, not {D}",
                shape.len()
            )));
        }
        Ok(Tensor::from_data(
            TensorData::new(self.values[i].clone(), shape),
            &self.engine.device,
        ))
    }

    /// Replaces a gathered parameter's values by a tensor of its shape (see
    /// [`values_mut`](Self::values_mut)).
    pub fn set_tensor<const D: usize>(&mut self, name: &str, tensor: Tensor<B, D>) -> Result<(), ZeroError> {
        self.check_writable(name)?;
        let shape = self.shape(name)?.to_vec();
        if tensor.dims().as_slice() != shape.as_slice() {
            return Err(ZeroError::Usage(format!(
                "set_tensor: `{name}` has shape {shape:?}, the tensor {:?}",
                tensor.dims()
            )));
        }
        let values = crate::params::tensor_to_vec(tensor);
        let i = self.index(name)?;
        self.values[i] = values;
        Ok(())
    }

    /// The gathered block as a module with fp32 parameters (a gather made by
    /// [`ChainEngine::gather_block`]).
    pub fn block(&self) -> Result<M::Block, ZeroError> {
        let b = self.block_index()?;
        let skeleton = self.engine.blocks[b].clone();
        Ok(write_values(skeleton, &self.engine.device, false, |i| {
            self.values[i].clone()
        }))
    }

    /// Takes every parameter value of `block` (a module of the gathered block's structure) as
    /// the new values (see [`values_mut`](Self::values_mut)).
    pub fn set_block(&mut self, block: &M::Block) -> Result<(), ZeroError> {
        self.block_index()?;
        if self.modifier_rank.is_none() {
            return Err(read_only("set_block"));
        }
        let mut new_values = Vec::with_capacity(self.values.len());
        read_values::<B, _>(block, |_, v| new_values.push(v));
        let same = new_values.len() == self.values.len()
            && new_values.iter().zip(&self.values).all(|(a, b)| a.len() == b.len());
        if !same {
            return Err(ZeroError::Usage(
                "set_block: the module's parameters do not match the gathered block's".into(),
            ));
        }
        self.values = new_values;
        Ok(())
    }

    /// Ends the gather: with a modifier rank, its values are broadcast and written into every
    /// rank's shard (masters, 16-bit copy, and the replica at stages 0-2).
    pub fn finish(mut self) -> Result<(), ZeroError> {
        self.finished = true;
        self.write_back()
    }

    fn write_back(&mut self) -> Result<(), ZeroError> {
        self.engine.core.memory.sub_gathered(self.bytes);
        self.bytes = 0;
        let Some(source) = self.modifier_rank else {
            return Ok(());
        };
        let core = &mut self.engine.core;
        if core.comm.world_size() > 1 {
            let mut flat = Vec::with_capacity(self.values.iter().map(Vec::len).sum());
            for v in &self.values {
                flat.extend_from_slice(v);
            }
            let mut buf = FlatBuffer::F32(flat);
            core.comm.broadcast(&mut buf, source)?;
            let flat = buf.into_f32();
            let mut at = 0;
            for v in &mut self.values {
                let n = v.len();
                v.copy_from_slice(&flat[at..at + n]);
                at += n;
            }
        }
        let rank = core.comm.rank();
        let places = core.places.clone();
        let groups: BTreeSet<usize> = self.params.iter().map(|&p| places[p].group).collect();
        for g in groups {
            for seg in core.state.layout.segments(g, rank) {
                let Some(i) = self.params.iter().position(|&p| p == seg.param) else {
                    continue;
                };
                let new = &self.values[i][seg.in_param.clone()];
                let state = &mut core.state.groups[g];
                state.master[seg.local.clone()].copy_from_slice(new);
                if let Some(half) = &mut state.half {
                    write_rounded(half, seg.local.start, new);
                }
            }
        }
        if core.settings.stage != Stage::Zero3 {
            self.engine.refresh_replica()?;
        }
        Ok(())
    }

    fn index(&self, name: &str) -> Result<usize, ZeroError> {
        let layout = &self.engine.core.state.layout;
        self.params
            .iter()
            .position(|&p| layout.params[p].name == name)
            .ok_or_else(|| ZeroError::Usage(format!("`{name}` is not one of the gathered parameters")))
    }

    fn check_writable(&self, name: &str) -> Result<(), ZeroError> {
        match self.modifier_rank {
            Some(_) => Ok(()),
            None => Err(read_only(&format!("changing `{name}`"))),
        }
    }

    fn block_index(&self) -> Result<usize, ZeroError> {
        match self.part {
            Some(part) if part > 0 => Ok(part - 1),
            _ => Err(ZeroError::Usage(
                "this gather is not a whole block (use ChainEngine::gather_block)".into(),
            )),
        }
    }
}

impl<B: AutodiffBackend, M: ChainModel<B>> Drop for GatheredParameters<'_, B, M> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if std::thread::panicking() {
            // No collective while unwinding: the other ranks would wait for this one.
            self.engine.core.memory.sub_gathered(self.bytes);
            return;
        }
        if let Err(e) = self.write_back() {
            // A drop cannot return the error; `finish` does.
            eprintln!("GatheredParameters dropped without finish(): writing the modified values back failed: {e}");
        }
    }
}

fn read_only(what: &str) -> ZeroError {
    ZeroError::Usage(format!(
        "{what}: the gather is read-only (gather with modifier_rank = Some(rank) to change parameters)"
    ))
}

/// Writes f32 values into a 16-bit (or f32) buffer from `start`, rounded to nearest even.
fn write_rounded(buf: &mut FlatBuffer, start: usize, values: &[f32]) {
    let end = start + values.len();
    match buf {
        FlatBuffer::F32(v) => v[start..end].copy_from_slice(values),
        FlatBuffer::BF16(v) => v[start..end]
            .iter_mut()
            .zip(values)
            .for_each(|(d, &s)| *d = bf16::from_f32(s)),
        FlatBuffer::F16(v) => v[start..end]
            .iter_mut()
            .zip(values)
            .for_each(|(d, &s)| *d = f16::from_f32(s)),
    }
}
