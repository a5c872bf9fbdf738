//! Scheduling: a whole call (`backend`) cut into work units (`units`, `unit_passes`) and
//! a ring block (`block`, via `piece`) cut into pieces, the selected rows of one pattern
//! segment, each handed to the tile loops; block masks split pieces (`block_split`) and
//! `score_bound` checks the inputs before anything runs.

pub(crate) mod backend;
pub mod block;
pub(crate) mod block_split;
pub(crate) mod disjoint;
pub(crate) mod piece;
pub(crate) mod score_bound;
pub(crate) mod unit_passes;
pub(crate) mod units;
