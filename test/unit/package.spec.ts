// Every package the extension imports is declared in package.json (its dependencies, or
// devDependencies for the unit tests): nothing works only because another package pulled
// it in.
import { readdirSync, readFileSync } from 'fs';
import { join } from 'path';
import * as ts from 'typescript';

const root = join(__dirname, '..', '..');
const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8'));

/** The packages (not relative paths, not Node's own modules) that `dir`'s files import. */
function imported(dir: string, ext: RegExp): Set<string> {
  const names = new Set<string>();
  for (const file of readdirSync(join(root, dir)).filter(f => ext.test(f))) {
    const text = readFileSync(join(root, dir, file), 'utf8');
    // TypeScript's own reading of the file's import and export ... from statements
    for (const { fileName: spec } of ts.preProcessFile(text, true, true).importedFiles) {
      if (spec.startsWith('.') || ['fs', 'path'].includes(spec)) {
        continue;
      }
      const parts = spec.split('/');
      names.add(spec.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0]);
    }
  }
  return names;
}

describe('package.json', () => {
  it('declares every package src/ and style/ import as a dependency', () => {
    const used = new Set([...imported('src', /\.ts$/), ...imported('style', /\.js$/)]);
    expect(used.size).toBeGreaterThan(5); // the pattern finds imports at all
    const undeclared = [...used].filter(n => !(n in pkg.dependencies));
    expect(undeclared).toEqual([]);
  });

  it('declares every package the unit tests import', () => {
    const declared = { ...pkg.dependencies, ...pkg.devDependencies };
    const undeclared = [...imported('test/unit', /\.ts$/)].filter(n => !(n in declared));
    expect(undeclared).toEqual([]);
  });
});
