// Drives the chat page at / in Debian's Chromium as a person would: sets the
// temperature to 0, types a message, presses Send, and once 20 tokens have
// streamed clicks "kill" on node 1; then starts a new chat, presses Stop while
// its answer streams, and sends a second turn. Prints one JSON object: the first answer as shown,
// its finish reason, the injection status, the second answer's finish reason
// and how many bubbles the conversation holds. With STRATA_SCREENSHOT set, saves
// a screenshot there (never into the repository).
// usage: node page_client.mjs BASE_URL MESSAGE MAX_TOKENS
import {chromium} from 'playwright-core';

const [base, message, maxTokens] = process.argv.slice(2);
const browser = await chromium.launch({executablePath: '/usr/bin/chromium', args: ['--no-sandbox', '--disable-gpu']});
try {
  const page = await browser.newPage();
  await page.goto(base + '/');
  await page.fill('#temperature', '0');
  await page.fill('#max_tokens', String(maxTokens));
  await page.fill('#message', message);
  await page.waitForSelector('#kill-1', {timeout: 10000}); // the cluster view with injection buttons
  await page.click('#send');
  await page.waitForFunction(() => Number(document.body.dataset.tokens || 0) >= 20, null, {timeout: 60000});
  await page.click('#kill-1');
  await page.waitForFunction(() => document.body.dataset.finish, null, {timeout: 60000});
  await page.waitForFunction(() => document.getElementById('inject_status').textContent.includes('kill sent'), null,
                             {timeout: 10000}).catch(() => {});
  const first = await page.evaluate(() => {
    const a = [...document.querySelectorAll('#conversation .assistant')].pop();
    return {text: a.firstChild ? a.firstChild.textContent : '', finish: document.body.dataset.finish,
            status: document.getElementById('inject_status').textContent};
  });
  // A new chat whose answer is stopped with the Stop button, then a second turn.
  // (The tiny test model answers in well under a second: a slow network keeps
  // the answer streaming into the page while Stop is pressed.)
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.enable');
  const network = (bytesPerSecond) => cdp.send('Network.emulateNetworkConditions',
    {offline: false, latency: 0, downloadThroughput: bytesPerSecond, uploadThroughput: -1});
  await page.click('#clear');
  await page.fill('#message', 'And then?');
  await network(4000);
  await page.press('#message', 'Enter');
  await page.waitForFunction(() => Number(document.body.dataset.tokens || 0) >= 3, null, {timeout: 60000});
  await page.click('#stop');
  await page.waitForFunction(() => document.body.dataset.finish, null, {timeout: 60000});
  await network(-1);
  const stopped = await page.evaluate(() => document.body.dataset.finish);
  await page.fill('#max_tokens', '8');
  await page.fill('#message', 'Go on.');
  await page.click('#send');
  await page.waitForFunction(() => document.body.dataset.finish === 'length', null, {timeout: 60000});
  const second = await page.evaluate(() => ({
    finish: document.body.dataset.finish,
    bubbles: document.querySelectorAll('#conversation .msg').length,
    send_enabled: !document.getElementById('send').disabled,
  }));
  if (process.env.STRATA_SCREENSHOT)
    await page.screenshot({path: process.env.STRATA_SCREENSHOT, fullPage: true});
  second.finish = stopped;
  console.log(JSON.stringify({...first, second}));
} finally {
  await browser.close();
}
