// Drives the page at / in Debian's Chromium as a person would: types a prompt,
// clicks Generate, and once 20 tokens have streamed clicks "kill" on node 1.
// Prints one JSON object: the text shown, the finish reason, the status line.
// usage: node page_client.mjs BASE_URL PROMPT MAX_TOKENS
import {chromium} from 'playwright-core';

const [base, prompt, maxTokens] = process.argv.slice(2);
const browser = await chromium.launch({executablePath: '/usr/bin/chromium', args: ['--no-sandbox', '--disable-gpu']});
try {
  const page = await browser.newPage();
  await page.goto(base + '/');
  await page.fill('#prompt', prompt);
  await page.fill('#max_tokens', String(maxTokens));
  await page.waitForSelector('#kill-1', {timeout: 10000}); // the route table with injection buttons
  await page.click('#go');
  await page.waitForFunction(() => Number(document.body.dataset.tokens || 0) >= 20, null, {timeout: 60000});
  await page.click('#kill-1');
  await page.waitForFunction(() => document.body.dataset.finish, null, {timeout: 60000});
  await page.waitForFunction(() => document.getElementById('status').textContent.includes('kill sent'), null,
                             {timeout: 10000}).catch(() => {});
  const out = await page.evaluate(() => ({
    text: document.getElementById('out').textContent,
    finish: document.body.dataset.finish,
    status: document.getElementById('status').textContent,
  }));
  console.log(JSON.stringify(out));
} finally {
  await browser.close();
}
