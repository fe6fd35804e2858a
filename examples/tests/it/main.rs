//! The integration tests of this crate, one module per file, built as one test binary (one
//! link of the crate and its dependencies instead of one per file). Tests that must own
//! their process (a counting global allocator, a process-wide default) stay files of
//! their own beside this directory.

mod support;
mod zero_module;

mod auto_values;
mod backend_choice;
mod export_hf;
mod faults_checkpoint;
mod faults_run;
mod faults_tp_checkpoint;
mod held_out_loss;
mod init_cli;
mod launched_ranks;
mod learner;
mod metrics_file;
mod monitors;
mod pipeline_resume;
mod pipeline_train;
mod resume;
mod seeded_init;
mod simple_example;
mod train_against_pytorch;
mod zero_module_checkpointing;
mod zero_module_gpt2;
mod zero_module_gpt2_resume;
