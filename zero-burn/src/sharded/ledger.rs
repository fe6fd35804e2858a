//! Every unit's gradient is reduce-scattered on every rank, whatever the data.
//!
//! A unit whose output did not reach this rank's loss (an expert that got no rows, a branch this
//! rank's data skipped) has no backward on this rank: left alone, its reduce-scatter would be
//! missing here while the other ranks wait in theirs, or, worse, another unit's would pair with
//! it. The ledger makes the order of a micro-batch's reduce-scatters a function of the model,
//! not of the batch:
//!
//! - every tracked gather of a forward (the units' calls, in order: the same on every rank, as
//!   every rank runs the same model and calls each unit every micro-batch) is an entry;
//! - each gather op takes the previous entry's *chain token* as a parent without a gradient, so
//!   that every earlier gather is an ancestor of every later one: a unit's gather is in this
//!   rank's backward whenever any later unit's is, and burn 0.21, which runs its tape deepest
//!   first, runs the gathers' backward steps in the reverse of the forward's order;
//! - the units after the last one whose gather is in this rank's backward are the ones this
//!   rank's loss never reached: when that last one's step runs, it first reduce-scatters a zero
//!   gradient for each of them (latest first), registering the result (the other ranks'
//!   average) as the unit's shard gradient.
//!
//! So on every rank the reduce-scatters run in the reverse forward order, one per entry, a
//! zero gradient where the unit did not reach the loss: the result is the one process's on the
//! whole batch. An entry is a rank's, so the ledger lives with the rank's thread (ranks are
//! threads or processes; a rank's forward and backward run on its thread).
//!
//! A collective that fails inside backward cannot return its error there: the error is kept
//! (the first one), the backward goes on with zeros (the group fails every later collective at
//! once), and the next forward of a unit or `ZeroOptimizer::try_step` returns it.

use crate::error::ZeroError;
use burn::backend::autodiff::grads::Gradients;
use std::any::Any;
use std::cell::RefCell;

/// What reduce-scatters a zero gradient for an entry whose unit did not reach the loss, and
/// registers the resulting shard gradient.
pub(crate) type Release = Box<dyn FnOnce(&mut Gradients) -> Result<(), ZeroError>>;

/// An entry's place: the forward it belongs to and its index in it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    generation: u64,
    index: usize,
}

#[derive(Default)]
struct Ledger {
    /// The forwards since the last backward, numbered.
    generation: u64,
    /// A backward of this generation has run a gather's step: the next forward starts anew.
    backward: bool,
    /// The entries in forward order; `None` once its reduce-scatter ran.
    entries: Vec<Option<Release>>,
    /// The last entry's chain token (an autodiff tensor of the gather's backend).
    chain: Option<Box<dyn Any>>,
    /// The first collective that failed inside a backward.
    error: Option<ZeroError>,
}

thread_local! {
    static LEDGER: RefCell<Ledger> = RefCell::new(Ledger::default());
}

/// Enters a tracked gather of a forward: its ticket and the previous entry's chain token (to
/// take as a parent). A failure kept from a backward is returned instead.
pub(crate) fn enter(release: Release) -> Result<(Ticket, Option<Box<dyn Any>>), ZeroError> {
    LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        if let Some(e) = l.error.take() {
            return Err(e);
        }
        if l.backward {
            l.generation += 1;
            l.backward = false;
            l.entries.clear();
            l.chain = None;
        }
        l.entries.push(Some(release));
        let ticket = Ticket {
            generation: l.generation,
            index: l.entries.len() - 1,
        };
        Ok((ticket, l.chain.take()))
    })
}

/// The token the next entry of this forward chains to.
pub(crate) fn set_chain(token: Box<dyn Any>) {
    LEDGER.with(|l| l.borrow_mut().chain = Some(token));
}

/// The gather of `ticket` runs its backward step: every later entry of its forward whose own
/// step has not run never will on this rank (see the module docs), so each gets its zero
/// reduce-scatter now, latest first. Then the caller reduce-scatters its own.
pub(crate) fn reached(ticket: Ticket, grads: &mut Gradients) {
    let later: Vec<Release> = LEDGER.with(|l| {
        let mut l = l.borrow_mut();
        if l.generation != ticket.generation {
            // A graph of an earlier forward, backward after a newer forward began: its
            // entries are gone; the unit's own reduce-scatter still runs.
            return Vec::new();
        }
        l.backward = true;
        let mut later: Vec<Release> = l.entries[ticket.index + 1..]
            .iter_mut()
            .filter_map(Option::take)
            .collect();
        later.reverse();
        l.entries[ticket.index] = None;
        later
    });
    for release in later {
        if let Err(e) = release(grads) {
            fail(e);
        }
    }
}

/// Keeps `e`, a collective's failure inside backward, unless an earlier one is kept.
pub(crate) fn fail(e: ZeroError) {
    LEDGER.with(|l| {
        l.borrow_mut().error.get_or_insert(e);
    });
}

/// The failure kept from a backward, if any (taken).
pub(crate) fn take_error() -> Option<ZeroError> {
    LEDGER.with(|l| l.borrow_mut().error.take())
}
