// model_facts::of reads the model's own tokenizer identity (model/tokenizer),
// which the wire-only code (and the fuzz target) does not need.

#include "messages/messages.hpp"
#include "model/text/tokenizer.hpp"

namespace strata::msg {

model_facts model_facts::of(const model::ModelConfig& cfg) {
  model_facts f;
  f.architecture = cfg.architecture;
  f.model = cfg.identity;
  f.n_layers = cfg.n_layers;
  f.vocab_size = cfg.vocab_size;
  f.max_seq_len = cfg.max_seq_len;
  f.bos_id = cfg.bos_id;
  f.eos_ids = cfg.eos_ids;
  f.n_experts = cfg.n_experts;
  f.n_experts_used = cfg.n_experts_used;
  f.sliding_window = cfg.sliding_window;
  f.swa_pattern = cfg.swa_pattern;
  // Only builtin tokenizers travel by name (a GGUF file's own stays with the file).
  if (cfg.identity.rfind("builtin:", 0) != 0)
    return f;
  if (auto tok = model::default_tokenizer_for(cfg))
    f.tokenizer = "builtin:" + tok->kind();
  return f;
}

} // namespace strata::msg
