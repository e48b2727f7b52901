"""Text in and out: tokenizers, drawing tokens, guided decoding, answer checks and the quality
measures of formats."""
