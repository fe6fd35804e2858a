//! `gpt2 score`: the mean next-token loss of a checkpoint on a token batch.

use super::data::DataSource;
use super::model::check_data;
use super::TrainError;
use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use std::path::PathBuf;
use zero_models::Gpt2;

/// Arguments of `gpt2 score`.
#[derive(clap::Args, Clone, Debug)]
pub struct ScoreArgs {
    /// A HuggingFace GPT-2 directory.
    #[arg(long)]
    pub model: PathBuf,
    /// A JSON array of equal-length token sequences.
    #[arg(long)]
    pub tokens: PathBuf,
}

/// The loss of the whole batch (labels = inputs), as HuggingFace computes it.
pub fn score(args: &ScoreArgs) -> Result<f64, TrainError> {
    let device = Default::default();
    let (model, config) =
        Gpt2::<Flex>::load_pretrained(&args.model, &device).map_err(|e| TrainError::Model(e.to_string()))?;
    let data = DataSource::from_tokens_file(&args.tokens)?;
    // Ids past the vocabulary or sequences past n_positions would index out of the model's
    // tables.
    check_data(&data, &format!("--tokens {}", args.tokens.display()), &config)?;
    let DataSource::Fixed(batch) = data else {
        unreachable!("a tokens file is a fixed batch")
    };
    let seq = batch[0].len();
    let ids: Vec<i64> = batch.iter().flatten().map(|&t| t as i64).collect();
    let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids, [batch.len(), seq]), &device);
    let loss = model.loss(tokens.clone(), tokens).into_scalar() as f64;
    if !loss.is_finite() {
        // Not a score: the weights hold a NaN or an infinity (a damaged file; HuggingFace's
        // format carries no checksums), or overflow.
        return Err(TrainError::Model(format!(
            "{}: the loss is {loss}: the model's weights hold non-finite values or overflow",
            args.model.display()
        )));
    }
    Ok(loss)
}
