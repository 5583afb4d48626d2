// Renders chat templates with @huggingface/jinja (the Jinja renderer of
// transformers.js): the reference tests/model/chat_template_test.cpp compares
// strata's engine with.
// usage: node render_templates.mjs CASES.json   (an array of {template, context})
// prints an array of {ok: true, text} or {ok: false, error}.
import { Template } from '@huggingface/jinja';
import { readFileSync } from 'node:fs';

const cases = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const out = cases.map(({template, context}) => {
  try {
    return {ok: true, text: new Template(template).render(context)};
  } catch (e) {
    return {ok: false, error: String(e?.message ?? e)};
  }
});
process.stdout.write(JSON.stringify(out));
