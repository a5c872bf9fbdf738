//! The integration tests of the runner in one binary; each module is one test file.

mod golden_multihead;
mod runner;
